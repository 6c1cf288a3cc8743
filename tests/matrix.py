"""The compatibility matrix, docs/reference/compatibility.md, generated: every layout against every feature.

A cell is refused where the checks every run passes before it starts refuse the combination (config.validate, the
strategy's check, and for BatchNorm a network with BatchNorm as a pipeline or tensor parallelism would take it): the
cell quotes that one-line refusal. A cell is equal where a test proves it, and says so with a mark:

    @pytest.mark.matrix(("pipeline", "EMA", "1.2e-7"), ("hybrid", "EMA", "1.2e-7"))

(layout, feature, the gap measured when the test's bound was set). Any other cell runs, and no test has compared
it yet: the page says so. tests/test_matrix.py insists the page on disk is the one generated here, so a refusal
lifted, a test added or a gap measured anew shows on the page.

    python tests/matrix.py            write the page
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "compatibility.md"

# name: (the configuration's fields, as written on the command line)
LAYOUTS: dict[str, tuple[dict, str]] = {
    "ddp": ({"strategy": "ddp"}, "`--strategy ddp`"),
    "tower": ({"strategy": "tower"}, "`--strategy tower` (its tests leave dropout out: its replicas draw the masks "
              "as one device does in distribution only)"),
    "fsdp": ({"strategy": "fsdp"}, "`--strategy fsdp`"),
    "hsdp": ({"strategy": "hsdp"}, "`--strategy hsdp`"),
    "tp": ({"strategy": "tp"}, "`--strategy tp`"),
    "pipeline": ({"strategy": "pipeline", "stages": 2}, "`--strategy pipeline --stages 2`"),
    "hybrid": ({"strategy": "hybrid", "stages": 2}, "`--strategy hybrid --stages 2` (pipelines x copies)"),
    "fsdp x tp": ({"strategy": "tp", "mesh": "fsdp=2,tp=2"}, "`--mesh fsdp=2,tp=2`"),
    "dp x tp x pp": ({"strategy": "tp", "mesh": "dp=2,tp=2,pp=2"}, "`--mesh dp=2,tp=2,pp=2`"),
    "fsdp x pp": ({"strategy": "tp", "mesh": "fsdp=2,pp=2"}, "`--mesh fsdp=2,pp=2` (sharded copies of a pipeline's "
                  "stages; a Hugging Face decoder's too: tests/test_decoder_pipeline.py)"),
}
# name: (the configuration's fields, the flag, what an equal cell compares the run with)
FEATURES: dict[str, tuple[dict, str, str]] = {
    "compile": ({"compile": True}, "`--compile`", "the same layout uncompiled (fsdp) or one device uncompiled "
                "(the others)"),
    "activation checkpointing": ({"activation_checkpointing": "full"}, "`--activation-checkpointing full`",
                                 "one device without it"),
    "bf16": ({"precision": "bf16"}, "`--precision bf16`", "one device in bf16"),
    "16-mixed": ({"precision": "16-mixed"}, "`--precision 16-mixed`", "one device in 16-mixed (CPUs, where the "
                 "equal cells were measured, run it as bf16 and say so at the start: fp16 has no fast CPU kernels)"),
    "float8": ({"precision": "float8"}, "`--precision float8` (GPUs of compute capability 8.9 or later; elsewhere "
               "refused in one line that names the devices' capability)", "one GPU in float8"),
    "EMA": ({"ema": 0.9}, "`--ema 0.9`", "one device with it"),
    "clipping": ({"clip_grad_norm": 1.0}, "`--clip-grad-norm 1`", "one device with it"),
    "accumulation": ({"accumulate": 2}, "`--accumulate 2`", "one device with it"),
    "BatchNorm sync": ({"batchnorm": "sync"}, "`--batchnorm sync`", "one device (a network with BatchNorm)"),
    "async checkpoints": ({"async_checkpoint": True}, "`--async-checkpoint`", "the same run saving in the loop "
                          "(ddp, fsdp) or one device saving in the loop (the others)"),
    "resume across layouts": ({}, "`--resume` under another layout or worker count",
                              "the run that never stopped"),
}


def marks(tests: Path = ROOT / "tests") -> dict[tuple[str, str], tuple[str, str]]:
    """(layout, feature) -> (gap, test) from every `pytest.mark.matrix` in the test files."""
    found: dict[tuple[str, str], tuple[str, str]] = {}
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            for decorator in node.decorator_list:
                if isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "pytest.mark.matrix":
                    for layout, feature, gap in (ast.literal_eval(a) for a in decorator.args):
                        if layout not in LAYOUTS or feature not in FEATURES:
                            raise ValueError(f"{path.name}::{node.name}: no layout {layout!r} or feature {feature!r}")
                        if (layout, feature) in found:  # one test a cell: the page names the one
                            raise ValueError(f"{path.name}::{node.name}: {layout} x {feature} is marked by "
                                             f"{found[(layout, feature)][1]} already")
                        found[(layout, feature)] = (gap, f"{path.name}::{node.name}")
    return found


def refusal(layout: str, feature: str) -> str | None:
    """The one line a run of `layout` with `feature` is refused with before it starts; None where it runs."""
    from torch import nn

    from paratrain import config
    from paratrain.core.errors import UserError
    from paratrain.parallel.strategies import checked
    from paratrain.parallel.strategies.pp import prepare_checks
    from paratrain.parallel.strategies.tensor_plan import plan_of
    from paratrain.parallel.strategies.tower import TowerStrategy

    fields = {**LAYOUTS[layout][0], **FEATURES[feature][0]}
    try:
        cfg = checked(config.validate(config.TrainConfig(**fields)))
        if feature == "BatchNorm sync":  # what a pipeline and tensor parallelism make of a network with BatchNorm
            net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
            if layout == "tower":
                TowerStrategy.check_network(net)
            if "pp" in layout or layout in ("pipeline", "hybrid"):
                prepare_checks(cfg, net)
            if "tp" in layout:
                plan_of(net, None)
    except UserError as e:
        return " ".join(str(e).split())
    return None


def page() -> str:
    """The page, from this suite's marks."""
    return page_from(marks())


def page_from(proved: dict[tuple[str, str], tuple[str, str]]) -> str:
    refusals: list[str] = []
    rows = []
    for layout in LAYOUTS:
        cells = []
        for feature in FEATURES:
            why = refusal(layout, feature)
            if why is not None and (layout, feature) in proved:
                raise ValueError(f"{proved[(layout, feature)][1]} proves {layout} x {feature}, which is refused: {why}")
            if why is not None:
                if why not in refusals:
                    refusals.append(why)
                cells.append(f"refused: [r{refusals.index(why) + 1}](#r{refusals.index(why) + 1})")
            elif (layout, feature) in proved:
                cells.append(f"equal ({proved[(layout, feature)][0]})")
            else:
                cells.append("runs on GPUs 8.9+" if feature == "float8" else "runs")
        rows.append(f"| {layout} | " + " | ".join(cells) + " |")
    tests = sorted({test for _, test in proved.values()})
    lines = [
        "# Compatibility matrix",
        "",
        "<!-- generated by tests/matrix.py from the code's checks and the tests' marks: do not edit; run",
        "     `python tests/matrix.py` (tests/test_matrix.py fails while this page differs from what it writes) -->",
        "",
        "Every layout against every feature. A cell says one of these things:",
        "",
        "- **equal (GAP)**: a test runs the combination on CPU workers and asserts that it ends with the weights",
        "  of the run the feature's column compares it with. GAP is the largest absolute difference in any",
        "  weight between the two runs, measured when the test's bound was set, after the test's steps (6 to",
        "  20; a gap grows with steps, bf16's fastest); the bound in the test is 1e-4 in float32 and 1.5e-2 in",
        "  bf16 unless the test says otherwise. Each cell tests one feature at a time. The tests are listed",
        "  below the table.",
        "- **refused**: the run stops before it starts, with the one line quoted under the table.",
        "- **runs**: nothing refuses it, but no test has compared it with that run yet.",
        "- **runs on GPUs 8.9+**: float8 needs a GPU of compute capability 8.9 or later (elsewhere it is refused",
        "  in one line); `tests/test_float8.py` trains the gpt in float8 against bf16 on one where there is one",
        "  (it skips without). No such GPU was at hand when these cells were written: they are unmeasured.",
        "",
        "| layout | " + " | ".join(FEATURES) + " |",
        "|---|" + "---|" * len(FEATURES),
        *rows,
        "",
        "## The layouts",
        "",
        *(f"- **{name}**: {flag}" for name, (_, flag) in LAYOUTS.items()),
        "",
        "## The features, and what an equal cell compares",
        "",
        *(f"- **{name}** ({flag}): against {against}" for name, (_, flag, against) in FEATURES.items()),
        "",
        "## The tests behind the equal cells",
        "",
        *(f"- `tests/{test}`" for test in tests),
        "",
        "## The refusals",
        "",
        *(f'- <a id="r{i}"></a>**r{i}**: {why}' for i, why in enumerate(refusals, 1)),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    PAGE.write_text(page())
    print(f"wrote {PAGE}", file=sys.stderr)

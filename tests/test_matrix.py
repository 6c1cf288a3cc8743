"""The compatibility matrix page (docs/reference/compatibility.md) is the one tests/matrix.py generates from the
code's refusals and the tests' `matrix` marks: a refusal lifted or a test added shows on the page, and a test that
claims a refused cell is an error."""

from __future__ import annotations

from pathlib import Path

import matrix
import pytest


def test_the_page_is_the_generated_one() -> None:
    assert matrix.PAGE.read_text() == matrix.page(), "run `python tests/matrix.py` and commit the page"


def test_every_equal_cell_names_a_test_of_the_suite_and_no_refused_cell_is_claimed(tmp_path: Path) -> None:
    proved = matrix.marks()
    assert ("pipeline", "EMA") in proved and ("fsdp", "async checkpoints") in proved
    for (layout, feature), (gap, test) in proved.items():
        name, function = test.split("::")
        assert f"def {function}(" in (Path(matrix.__file__).parent / name).read_text()
        assert matrix.refusal(layout, feature) is None, (layout, feature)
        float(gap)  # a measured figure
    claim = tmp_path / "test_claim.py"
    claim.write_text('import pytest\n\n\n@pytest.mark.matrix(("tower", "compile", "0"))\ndef test_x():\n    pass\n')
    with pytest.raises(ValueError, match="test_claim.py::test_x proves tower x compile, which is refused"):
        matrix.page_from(matrix.marks(tmp_path))
    claim.write_text('import pytest\n\n\n@pytest.mark.matrix(("ddp", "warp drive", "0"))\ndef test_x():\n    pass\n')
    with pytest.raises(ValueError, match="no layout 'ddp' or feature 'warp drive'"):
        matrix.marks(tmp_path)


def test_a_refusal_is_the_line_the_run_stops_with() -> None:
    assert "--compile is not available with --strategy tower" in matrix.refusal("tower", "compile")
    assert "cannot keep --batchnorm sync" in matrix.refusal("pipeline", "BatchNorm sync")
    assert matrix.refusal("ddp", "BatchNorm sync") is None and matrix.refusal("fsdp", "compile") is None

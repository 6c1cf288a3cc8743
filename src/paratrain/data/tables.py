"""Data from files for the command line, as tensors (kind "tensors"): a tensors file (--dataset tensors: an .npz,
or a folder of .npy / .pt files) and a CSV table (--dataset csv --target COLUMN).

The arrays are named as Keras names them: x_train, y_train, x_val, y_val, x_test, y_test. Without x_val (or
x_test), the validation (or test) rows are held out of the training rows; without any split, x and y are the
whole set. Held-out rows are chosen by a fixed permutation (seed 0, whatever the run's seed), so a table sorted
by its target still gets every kind of row in every split, and every run on the file gets the same split."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

import torch

from ..core.errors import UserError
from .mapped import MappedTensor, take
from .splits import Splits
from .tensors import bad_rows, tensor_splits

SPLITS = ("train", "val", "test")
# a CSV target of whole numbers below this is class indices 0..19; others (a price, a year, a count) are a
# regression's numbers (--loss mse makes any class indices numbers too)
MAX_CLASSES_AS_NUMBERS = 20
SUFFIXES = (".npy", ".pt")
HOLD_OUT_SPLIT = "permutation-0"  # what Splits.split records: held out by the fixed permutation


EVERY_ROW = "every-row"  # what Splits.split records: the file's rows are all test rows (hold_out False)


def fingerprint(where: Path) -> str:
    """What tells the file a run held rows out of from another (a copy of it has the same): the size and the
    first and last MiB of the file, or of each of a folder's .npy and .pt files (reading no more, however
    large); a file sorted or shuffled anew, or edited near its ends, differs."""
    import hashlib

    files = sorted(f for f in where.iterdir() if f.suffix in SUFFIXES) if where.is_dir() else [where]
    digest = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        with open(f, "rb") as data:
            head = data.read(FINGERPRINT_BYTES)
            data.seek(max(0, size - FINGERPRINT_BYTES))
            named = f"{f.name}:" if where.is_dir() else ""  # a folder's arrays by name; a file by its content
            digest.update(f"{named}{size}:".encode() + head + data.read())
    return digest.hexdigest()


FINGERPRINT_BYTES = 2**20


def _with_origin(splits: Splits, where: Path) -> Splits:
    from dataclasses import replace

    if splits.split != HOLD_OUT_SPLIT:
        return splits
    rows = sum(len(getattr(splits, s)[1]) for s in ("train", "val", "test"))
    return replace(splits, origin={"rows": rows, "fingerprint": fingerprint(where)})


def load_tensors(path: str | os.PathLike, val_size: int | None, test_size: int | None,
                 hold_out: bool = True) -> Splits:
    """--dataset tensors --data-dir PATH: an .npz file, or a folder of NAME.npy / NAME.pt files. `hold_out`
    False: nothing is held out, and a file without x_test is all test rows (evaluating another file)."""
    where = Path(path).expanduser()
    if where.is_dir():
        arrays = _folder(where)
    elif where.is_file():
        arrays = _npz(where)
    else:
        raise UserError(f"--data-dir {where}: no such file or folder; give an .npz file or a folder of .npy / .pt "
                        "files (x_train.npy, y_train.npy, ...)")
    return _with_origin(split_rows(arrays, where, val_size, test_size, names=None, hold_out=hold_out), where)


def _npz(path: Path) -> dict[str, torch.Tensor]:
    import zipfile

    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as f:  # no pickles: an .npz may come from anyone
            return {k: _tensor(f[k], f"{path}: {k}") for k in f.files}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise UserError(f"{path} cannot be read as an .npz file of arrays ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:120]}); write it with numpy.savez(path, x_train=..., "
                        "y_train=...)") from None


def _folder(folder: Path) -> dict[str, torch.Tensor]:
    import numpy as np

    arrays = {}
    for file in sorted(folder.iterdir()):
        if file.suffix not in SUFFIXES or not file.is_file():
            continue
        if file.stem in arrays:
            raise UserError(f"{folder} holds both {file.stem}.npy and {file.stem}.pt; keep one")
        try:
            if file.suffix == ".npy" and file.stem.split("_")[0] == "x":  # inputs stay in the file (mapped.py)
                arrays[file.stem] = _mapped(file)
                continue
            value = np.load(file, allow_pickle=False) if file.suffix == ".npy" else \
                torch.load(file, map_location="cpu", weights_only=True)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 (a cut file, a pickle with code in it: said in one line)
            raise UserError(f"{file} cannot be read as a tensor ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:120]}); save it with numpy.save or torch.save") from None
        arrays[file.stem] = _tensor(value, str(file))
    if not arrays:
        raise UserError(f"{folder} holds no .npy or .pt files; give x_train.npy and y_train.npy (and x_test, y_test)")
    return arrays


def _mapped(file: Path) -> MappedTensor:
    """An .npy file of inputs, left in the file: each worker reads its rows of each batch from it."""
    import numpy as np

    array = np.load(file, mmap_mode="r", allow_pickle=False)
    if array.dtype.kind not in "iuf" or array.ndim == 0:
        raise UserError(f"{file} holds {array.dtype} values{' (one number)' if array.ndim == 0 else ''}; give an "
                        "array of numbers (floats or integers), a row per example")
    return MappedTensor(str(file))


def _tensor(value: object, where: str) -> torch.Tensor:
    import numpy as np

    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise UserError(f"{where} holds {value.dtype} values; give numbers (floats or integers)")
        return torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise UserError(f"{where} holds a {type(value).__name__}, not a tensor")
    return value


def _check_finite(x: torch.Tensor | MappedTensor, y: torch.Tensor, where: Path, lines: bool) -> None:
    for what, t in (("inputs", x), ("targets", y)):
        if not t.is_floating_point() or not len(t):
            continue
        first, count = bad_rows(t)
        if first is not None:
            place = f"data row {first + 1}" if lines else f"row {first}"  # a CSV's: after its header, from 1
            rows = f"{count} rows do" if count > 1 else "1 row does"
            raise UserError(f"{where}, {place}: the {what} hold an empty cell, NaN or inf ({rows}); drop or fill "
                            "those rows")


def split_rows(arrays: dict[str, torch.Tensor], where: Path, val_size: int | None, test_size: int | None,
           names: tuple[str, ...] | None, lines: bool = False, hold_out: bool = True) -> Splits:
    """The three splits from the arrays a file holds, the missing ones held out of the training rows."""
    given = {s for s in SPLITS if f"x_{s}" in arrays or f"y_{s}" in arrays}
    for s in given:
        for half in ("x", "y"):
            if f"{half}_{s}" not in arrays:
                raise UserError(f"{where} has {'y' if half == 'x' else 'x'}_{s} but no {half}_{s}; give both")
    if not given:
        if "x" not in arrays or "y" not in arrays:
            raise UserError(f"{where} holds {', '.join(sorted(arrays))}; name the arrays x_train, y_train (and x_val, "
                            "y_val, x_test, y_test), or x and y for a set to split")
        pairs = {"train": (arrays["x"], arrays["y"])}
    elif "train" not in given:
        raise UserError(f"{where} has no x_train and y_train; give the training set")
    else:
        pairs = {s: (arrays[f"x_{s}"], arrays[f"y_{s}"]) for s in sorted(given)}
    x, y = pairs["train"]
    if len(x) != len(y):
        raise UserError(f"{where}: {len(x)} training inputs and {len(y)} targets; give one target per input")
    if not given:  # the rows as the file has them, before any is held out: a bad one is named by its place
        _check_finite(x, y, where, lines)
    if not hold_out and "test" not in pairs:  # every row is a test row
        rows = list(pairs.values())
        if len(rows) > 1 and any(isinstance(r[0], MappedTensor) for r in rows):
            raise UserError(f"{where} has no x_test, and its inputs stay in their files: give x_test and y_test to "
                            "evaluate on")
        every = rows[0] if len(rows) == 1 else (torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]))
        pairs = {"train": every, "val": (every[0][:0], every[1][:0]), "test": every}
        return tensor_splits(pairs, where.name, names, EVERY_ROW, where=f"{where}: the {{}} split")
    held, order = [s for s in ("test", "val") if s not in pairs], None
    if held:
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    for s in held:  # test first: the validation rows come from what is left to train on
        size = test_size if s == "test" else val_size
        n = math.ceil(len(order) / 10) if size is None else size
        if n >= len(order):
            raise UserError(f"{where}: {len(order)} training rows cannot give {n} {s} rows and keep some to train on; "
                            f"give --{s}-size below {len(order)}")
        pairs[s] = (take(x, order[:n]), y[order[:n]])
        order = order[n:]
    if held:
        kept = order.sort().values  # in the file's order
        pairs["train"] = (take(x, kept), y[kept])
    if not len(pairs["test"][1]):
        raise UserError(f"{where}: the test split holds no rows; give x_test and y_test, or --test-size 1 or more")
    return tensor_splits(pairs, where.name, names, HOLD_OUT_SPLIT if held else None,
                         where=f"{where}: the {{}} split")


def load_csv(path: str | os.PathLike, target: str | None, val_size: int | None, test_size: int | None,
             hold_out: bool = True) -> Splits:
    """--dataset csv --data-dir FILE --target COLUMN[,COLUMN]: every other column is a numeric feature.
    A target column of numbers is a regression's (floats); a target column of names (text) is classes,
    numbered in sorted order; whole numbers written without a decimal point, all below MAX_CLASSES_AS_NUMBERS,
    are class indices."""
    where = Path(path).expanduser()
    if not target:
        raise UserError("--dataset csv needs --target COLUMN: the column to predict (several: A,B)")
    if not where.is_file():
        raise UserError(f"--data-dir {where}: no such file; give the CSV table's path")
    with open(where, newline="", encoding="utf-8-sig") as f:  # -sig: a spreadsheet's byte-order mark
        rows = list(csv.reader(f))
    rows = [r for r in rows if any(cell.strip() for cell in r)]
    if len(rows) < 2:
        raise UserError(f"{where} holds {'no header' if not rows else 'a header and no rows'}; give a header line of "
                        "column names and a row per example")
    header = [h.strip() for h in rows[0]]
    wanted = [t.strip() for t in target.split(",")]
    missing = [t for t in wanted if t not in header]
    if missing:
        from ..core.errors import closest

        close = closest(missing[0], header)
        raise UserError(f"--target {missing[0]}: {where} has no such column"
                        + (f" (did you mean {close}?)" if close else "")
                        + f"; its columns: {', '.join(header[:20])}{' ...' if len(header) > 20 else ''}")
    for i, r in enumerate(rows[1:], start=2):
        if len(r) != len(header):
            raise UserError(f"{where}, data row {i - 1}: {len(r)} cells, and the header names {len(header)} columns; "
                            "give every row a cell per column")
    columns = {h: [r[j].strip() for r in rows[1:]] for j, h in enumerate(header)}
    features = [h for h in header if h not in wanted]
    if not features:
        raise UserError(f"{where}: every column is a --target; leave at least one to predict from")
    text = [h for h in features if _not_numbers(columns[h])]
    if text:
        h = text[0]
        example = next(c for c in columns[h] if not _number(c))
        held = f"{h!r} holds {example!r}" if len(text) > 1 else f"it holds {example!r}"
        raise UserError(f"{where}: column{'s' if len(text) > 1 else ''} {', '.join(text[:5])} "
                        f"{'are' if len(text) > 1 else 'is'} not numbers ({held}); paratrain reads numeric features "
                        "only: encode categories as numbers (one-hot) or drop those columns")
    x = torch.tensor([[_number(c) for c in columns[h]] for h in features], dtype=torch.float64).T.contiguous()
    y, names = _targets(where, wanted, columns)
    return _with_origin(split_rows({"x": x, "y": y}, where, val_size, test_size, names, lines=True,
                                   hold_out=hold_out), where)


def _targets(where: Path, wanted: list[str], columns: dict[str, list[str]]) -> tuple[torch.Tensor, tuple | None]:
    if len(wanted) == 1 and _not_numbers(columns[wanted[0]]):  # class names
        cells = columns[wanted[0]]
        if any(not c for c in cells):
            row = cells.index("") + 1
            raise UserError(f"{where}, data row {row}: the --target {wanted[0]} cell is empty; fill or drop that row")
        names = tuple(sorted(set(cells)))
        index = {n: i for i, n in enumerate(names)}
        return torch.tensor([index[c] for c in cells]), names
    for t in wanted:
        if _not_numbers(columns[t]):
            raise UserError(f"{where}: --target {t} holds text, and several target columns must be numbers")
    cells = columns[wanted[0]]
    if len(wanted) == 1 and all(c.isdigit() and int(c) < MAX_CLASSES_AS_NUMBERS for c in cells):
        return torch.tensor([int(c) for c in cells]), None  # a few whole numbers: class indices
    y = torch.tensor([[_number(c) for c in columns[t]] for t in wanted], dtype=torch.float64).T
    return (y[:, 0] if len(wanted) == 1 else y).contiguous(), None


MISSING = {"", "na", "n/a", "nan", "null", "none", "?"}  # how tables write a missing value


def _number(cell: str) -> float | None:
    """A cell's number (a missing one's, empty or NA, is NaN: refused naming its row), or None for text."""
    if cell.lower() in MISSING:
        return math.nan
    try:
        return float(cell)
    except ValueError:
        return None


def _not_numbers(cells: list[str]) -> bool:
    return any(c and _number(c) is None for c in cells)


TARGET_KEYS = ("y", "target", "targets", "label", "labels")  # a dict item's targets; its one other entry: inputs


def is_tensors_item(item: object) -> bool:
    """Whether a Dataset's item is an example of tensors (kind "tensors"), not an (image, label) pair: a dict,
    or a pair whose input is no image (a table's row, a sequence: not 2-D or 3-D; 3-D without 1 or 3 channels
    first or last; 2-D floats outside 0..1) or whose target is not one number (a multi-label row). PIL images,
    and arrays shaped as images with one label, are images (a float label among them is refused as a class
    index: give dict items for a regression on images)."""
    import numpy as np

    if isinstance(item, dict):
        return True
    if not (isinstance(item, tuple | list) and len(item) == 2):
        return False
    x, y = item
    if not isinstance(x, torch.Tensor | np.ndarray):
        return False  # a PIL image, say
    several = isinstance(y, torch.Tensor | np.ndarray) and (y.numel() if isinstance(y, torch.Tensor) else y.size) != 1
    t = torch.as_tensor(x)
    if t.dim() == 3:  # C x H x W or H x W x C with 1 or 3 (4) channels; else a stack of sequences, say
        image = t.shape[0] in (1, 3) or t.shape[-1] in (1, 3, 4)
    elif t.dim() == 2:  # a gray image (bytes, or floats in 0..1); else a sequence of feature rows, say
        image = not t.is_floating_point() or (t.numel() > 0 and 0 <= float(t.min()) and float(t.max()) <= 1)
    else:
        image = False
    return not image or several


def from_items(dataset: object, val_size: int | None, test_size: int | None) -> Splits:
    """A map-style Dataset of (inputs, targets) pairs (or dicts of two tensors, TARGET_KEYS naming the
    targets), read once into memory and split as a tensors file without x_test is (tables.split_rows)."""
    n = len(dataset)  # type: ignore[arg-type]
    if n < 3:
        raise UserError(f"your dataset has {n} item(s); it needs at least one each to train, validate and test")
    inputs, targets = [], []
    for i in range(n):
        x, y = _pair(dataset[i], i)  # type: ignore[index]
        inputs.append(torch.as_tensor(x))
        targets.append(torch.as_tensor(y))
    for what, items in (("inputs", inputs), ("targets", targets)):
        odd = next((i for i, t in enumerate(items) if t.shape != items[0].shape), None)
        if odd is not None:
            raise UserError(f"item {odd} of your dataset has {what} of shape {tuple(items[odd].shape)}, item 0 "
                            f"{tuple(items[0].shape)}; give every item the same shapes (pad sequences to one length)")
    return split_rows({"x": torch.stack(inputs), "y": torch.stack(targets)}, Path("your dataset"), val_size,
                      test_size, None)


def _pair(item: object, i: int) -> tuple[object, object]:
    if isinstance(item, dict):
        named = [k for k in item if k in TARGET_KEYS]
        if len(item) != 2 or len(named) != 1:
            raise UserError(f"item {i} of your dataset is a dict with keys {', '.join(map(str, item))}: give two "
                            f"entries, the inputs and the targets (named one of {', '.join(TARGET_KEYS)})")
        return next(v for k, v in item.items() if k != named[0]), item[named[0]]
    if not (isinstance(item, tuple | list) and len(item) == 2):
        raise UserError(f"item {i} of your dataset is a {type(item).__name__}, not an (inputs, targets) pair")
    return item[0], item[1]

"""Prompt datasets in the formats verl, OpenRLHF and TRL use: parquet files and `datasets` datasets.

Owns: reading rows from a parquet file (or a folder of them, through pyarrow) and from a local
Hugging Face dataset (a `save_to_disk` folder, a folder of data files, or one parquet / JSON /
JSONL / CSV / arrow file, through `datasets`), checking that the mapped columns exist, and handing
each row to `parse_row` with its file and row number. Rows count from 0, as `dataset[i]` does.

Must never: download (a path that is not on disk fails; nothing is looked up on the Hub), skip a
row, or need pyarrow / datasets unless such a source is configured (both are optional extras:
`pip install 'asyncrl[data]'`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from asyncrl.data.prompts import ColumnMap, Prompt, PromptDataError, parse_row

_DATASETS_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}


def _need(module: str, kind: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise PromptDataError(f"data.kind={kind!r} needs the `{module.split('.')[0]}` package: "
                              "pip install 'asyncrl[data]'") from None


def _check_columns(available: Iterable[str], columns: ColumnMap, where: str) -> None:
    have = set(available)
    missing = sorted(columns.top_level() - have - ({"metadata"} if columns.metadata is None else set()))
    if missing:
        raise PromptDataError(f"{where}: no column {', '.join(repr(m) for m in missing)} (columns: {', '.join(sorted(have))}); "
                              "map yours with data.columns.prompt / answer / metadata")


def _parse_all(rows: Iterator[tuple[int, Any]], where: str, columns: ColumnMap) -> list[Prompt]:
    return [parse_row(row, f"{where} row {i}", columns) for i, row in rows]


def _parquet_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.rglob("*.parquet"))
        if files:
            return files
        raise PromptDataError(f"{path}: a folder with no .parquet file")
    raise PromptDataError(f"prompts file not found: {path}")


def load_parquet_prompts(path: str | Path, columns: ColumnMap = ColumnMap()) -> list[Prompt]:
    """Prompts from a parquet file, or every `*.parquet` under a folder (in name order)."""
    pq = _need("pyarrow.parquet", "parquet")
    prompts: list[Prompt] = []
    for file in _parquet_files(Path(path)):
        try:
            pf = pq.ParquetFile(file)
        except Exception as err:  # pyarrow raises several types for a file that is not parquet
            raise PromptDataError(f"{file}: not a readable parquet file ({type(err).__name__}: {err})") from None
        _check_columns(pf.schema_arrow.names, columns, str(file))
        wanted = sorted(set(pf.schema_arrow.names) & (columns.top_level() | {"metadata"}))

        def rows(pf=pf, wanted=wanted) -> Iterator[tuple[int, Any]]:
            i = 0
            for batch in pf.iter_batches(batch_size=4096, columns=wanted):
                for row in batch.to_pylist():
                    yield i, row
                    i += 1

        prompts += _parse_all(rows(), str(file), columns)
    if not prompts:
        raise PromptDataError(f"{path}: no prompts")
    return prompts


def _open_dataset(path: Path, split: str) -> tuple[Any, str]:
    """(the split as a `datasets.Dataset`, how to name it in errors)."""
    datasets = _need("datasets", "hf_dataset")
    if not path.exists():
        raise PromptDataError(f"dataset not found: {path} (data.kind 'hf_dataset' reads local datasets only: "
                              "a save_to_disk folder, a folder of data files, or one file)")
    try:
        if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise PromptDataError(f"{path}: no split {split!r} (splits: {', '.join(ds)}); set data.split / data.eval_split")
                return ds[split], f"{path} [{split}]"
            if split != "train":
                raise PromptDataError(f"{path} is one dataset without splits; data.split={split!r} must be 'train' (its name here)")
            return ds, str(path)
        if path.is_dir():
            return datasets.load_dataset(str(path), split=split), f"{path} [{split}]"
        builder = _DATASETS_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise PromptDataError(f"{path}: cannot tell the format from the suffix {path.suffix!r} "
                                  f"(one of {', '.join(_DATASETS_BUILDERS)}; or a dataset folder)")
        if split != "train":
            raise PromptDataError(f"{path} is one file, one split; data.split={split!r} must be 'train' (give the "
                                  "other split's file as data.eval_path)")
        return datasets.load_dataset(builder, data_files={"train": str(path)}, split="train"), str(path)
    except PromptDataError:
        raise
    except ValueError as err:  # datasets' "Unknown split" and friends
        raise PromptDataError(f"{path}: {err}") from None
    except Exception as err:  # a file that its builder cannot read
        raise PromptDataError(f"{path}: datasets could not load it ({type(err).__name__}: {err})") from None


def load_hf_dataset_prompts(path: str | Path, split: str = "train", columns: ColumnMap = ColumnMap()) -> list[Prompt]:
    """Prompts from split `split` of a local Hugging Face dataset."""
    ds, where = _open_dataset(Path(path), split)
    _check_columns(ds.column_names, columns, where)
    prompts = _parse_all(enumerate(ds), where, columns)
    if not prompts:
        raise PromptDataError(f"{where}: no prompts")
    return prompts

"""Parquet files as a pre-training source (``DataConfig.source = 'parquet:<globs>'``): one
column of text read through pyarrow, row group by row group."""

from __future__ import annotations

import bisect
from typing import Sequence

from dagmoe_jax.validate import first_line


def _pq():
    """pyarrow.parquet, imported when a Parquet source is opened (pyarrow comes with the
    harness's datasets and is needed by nothing else)."""
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    return pq


class ParquetSource:
    """Column ``text_key`` of Parquet files, read by column through pyarrow: each record is a
    row (rows whose text is empty or null count as records and read as ''; the pipeline skips
    empty documents). Rows are addressed through the files' row groups, and the row group last
    read is kept (one at a time), so reading in order, or a corpus shuffled when it was
    written, reads each row group once. A file without the column is a one-line error naming
    it and the columns it has."""

    def __init__(self, files: Sequence[str], text_key: str, where: str):
        self.files, self.text_key = list(files), text_key
        self._groups = []                   # (first row, file index, row group, rows)
        start = 0
        for k, path in enumerate(self.files):
            try:
                meta = _pq().ParquetFile(path).metadata
            except Exception as err:  # pylint: disable=broad-except  (pyarrow raises many)
                raise ValueError(f"{where}: {path} is not a Parquet file "
                                 f"({first_line(err)})") from None
            names = [meta.schema.column(i).name for i in range(meta.num_columns)]
            if text_key not in names:
                raise ValueError(f"{where}: {path} has no column DataConfig.text_key="
                                 f"{text_key!r} (columns: {', '.join(map(repr, names))}): set "
                                 "text_key")
            for g in range(meta.num_row_groups):
                rows = meta.row_group(g).num_rows
                if rows:
                    self._groups.append((start, k, g, rows))
                    start += rows
        self._rows = start
        self._starts = [g[0] for g in self._groups]
        self._cached = (None, None)

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, index: int) -> str:
        index = int(index) % self._rows
        group = bisect.bisect_right(self._starts, index) - 1
        if self._cached[0] != group:
            first, k, g, _ = self._groups[group]
            try:
                column = _pq().ParquetFile(self.files[k]).read_row_group(
                    g, columns=[self.text_key])
            except Exception as err:  # pylint: disable=broad-except  (pyarrow raises many)
                raise ValueError(f"{self.files[k]} row group {g} cannot be read "
                                 f"({first_line(err)}): the file is damaged; copy it again or "
                                 f"leave it out of DataConfig.source") from None
            self._cached = (group, column.column(0).to_pylist())
        value = self._cached[1][index - self._groups[group][0]]
        return "" if value is None else str(value)

    def __getstate__(self):
        return {**self.__dict__, "_cached": (None, None)}

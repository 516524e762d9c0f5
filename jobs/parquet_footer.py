"""What a Parquet file's footer tells before any data page is read (jobs/input_reader.py checks every
input file with it, before a model loads): every column chunk lies inside the file, an `id` column
has no null (the statistics' null counts), uint64 ids fit the output's int64.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from jobs.input_files import InputError

if TYPE_CHECKING:
    from jobs.input_reader import InputFile

INT64_MAX = 2**63 - 1


def check_chunks(path: str, meta, size: int) -> None:
    """What the footer lets us check of the data without reading it: every column chunk lies inside the file."""
    for rg in range(meta.num_row_groups):
        g = meta.row_group(rg)
        for c in range(g.num_columns):
            col = g.column(c)
            # (some writers put 0 in dictionary_page_offset for "none": trust it only with a dictionary page)
            start = col.dictionary_page_offset if col.has_dictionary_page and col.dictionary_page_offset else \
                col.data_page_offset
            if start is None or start < 0 or start + col.total_compressed_size > size:
                raise InputError(f"{path}: row group {rg}, column `{col.path_in_schema}` lies outside the file "
                                 f"({size} bytes): the file is truncated or corrupt")


def no_null_ids(f: InputFile, fs: pafs.FileSystem, meta, kind: str) -> None:
    """A file with ids needs one in every row, refused up front by the footer statistics (a null cannot
    fall back to a derived id: an integer one would change the type, a string one `<file>:<row>` may be
    another row's real id, which would then be skipped as its duplicate). Nulls the statistics miss
    are caught at run time: those rows alone are listed as unreadable (input_reader `_null_ids`)."""
    col = next(i for i in range(meta.num_columns) if meta.schema.column(i).path == "id")   # (leaf, not field, index)
    offset = 0
    for rg in range(meta.num_row_groups):
        st = meta.row_group(rg).column(col).statistics
        if st is not None and st.has_null_count and st.null_count:
            raise InputError(f"{f.display}: the {kind} `id` column has {st.null_count} null value(s) in row group "
                             f"{rg} ({_null_rows(f, fs, rg, offset)}); give every row an id, or drop the `id` "
                             "column for derived ids (`<file>:<row>`)")
        offset += meta.row_group(rg).num_rows


def ids_fit_int64(f: InputFile, fs: pafs.FileSystem, meta) -> None:
    """Integer ids come out as int64: a uint64 id above 2**63-1 is refused up front (it would fail the
    commit), by the footer's max where the statistics have one, else by reading that row group's ids."""
    col = next(i for i in range(meta.num_columns) if meta.schema.column(i).path == "id")
    with contextlib.ExitStack() as opened:
        data = None                      # the file, opened once for the row groups without statistics
        for rg in range(meta.num_row_groups):
            st = meta.row_group(rg).column(col).statistics
            if st is not None and st.has_min_max:
                top = st.max
            else:
                try:
                    data = data or pq.ParquetFile(opened.enter_context(fs.open_input_file(f.path)))
                    top = pc.max(data.read_row_group(rg, columns=["id"]).column("id")).as_py()
                except Exception:   # unreadable data pages: the job reports them when it reads the file
                    continue
            if top is not None and top > INT64_MAX:
                raise InputError(f"{f.display}: the uint64 `id` column holds {top} in row group {rg}, above the "
                                 f"int64 maximum {INT64_MAX} of the output's integer ids; renumber the ids, or "
                                 "cast the column to string")


def _null_rows(f: InputFile, fs: pafs.FileSystem, rg: int, offset: int) -> str:
    """Which rows of the file have a null id (the first few), read from that row group's `id` column alone."""
    try:
        with fs.open_input_file(f.path) as fh:
            ids = pq.ParquetFile(fh).read_row_group(rg, columns=["id"]).column("id")
        rows = [offset + i for i, v in enumerate(ids.is_null().to_pylist()) if v]
    except Exception:    # unreadable data pages: the job reports them when it reads the file
        return "rows unknown"
    return rows_text(rows[:5], len(rows))


def rows_text(first: list[int], n: int) -> str:
    """`row 3` / `rows 3, 5, 8, 13, 21 and 4 more`: the first rows of `n`."""
    return ("row " if n == 1 else "rows ") + ", ".join(map(str, first[:5])) + (f" and {n - 5} more" if n > 5 else "")

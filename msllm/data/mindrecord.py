"""MindRecord I/O for the training data: atomic writing, metadata sidecar, checks, path resolution.

Layout written by :func:`write_mindrecord` for an output ``X.mindrecord``:

* ``X.mindrecord``      the data file (``mindspore.mindrecord.FileWriter``, ``shard_num=1``),
* ``X.mindrecord.db``   its SQLite index, written by the same ``FileWriter``,
* ``X.mindrecord.json`` the preprocessing metadata sidecar (see :data:`SIDECAR_KEYS`).

With ``shard_num=N > 1`` (``llama_preprocess.py --file_partition N``, as MindFormers writes it)
``FileWriter`` names the files ``X.mindrecord0`` ... ``X.mindrecord{N-1}`` (file name + shard
index; each with its ``.db``) and spreads the rows over them; every header lists all N names
(``shard_addresses``), and MindSpore's readers given one of them load the whole group (verified
with mindspore 2.10.0). Each shard gets a sidecar ``X.mindrecord{i}.json`` with the group's
metadata (``num_samples`` = rows of the whole group). The output name needs no ``.mindrecord``
suffix (MindFormers' default is ``./dataset/wiki2048/wiki2048``): the data files are recognised
by their ``.db`` companion.

Schema (fixed; the trainer reads it): two columns ``input_ids`` and ``labels``, both
``{"type": "int32", "shape": [-1]}``, every row exactly ``seq_length + 1`` long.

Renaming a MindRecord breaks it (verified by experiment with mindspore 2.10.0): the data file's
header stores ``"shard_addresses": ["X.mindrecord"]`` and the ``.db`` stores the same basename in
its ``SHARD_NAME`` table; ``MindDataset`` opens the shard recorded there, resolved in the
directory of the file it was given. So ``X.mindrecord`` renamed to ``Y.mindrecord`` fails with
"Invalid file, mindrecord file: .../X.mindrecord can not be found ... do not rename", while
moving both files to another directory under the *same* basename reads fine. Hence atomic
writing here = write under the final basename inside a fresh temporary directory beside the
output, then ``os.replace`` the ``.db``, the sidecar and finally the data file into place (same
file system, so each move is an atomic rename) and remove the temporary directory. On any error
the temporary directory is deleted and nothing appears under the final names.

MindSpore is imported lazily (inside functions): importing it takes ~1.5 s and starts threads,
and the tokenizer worker processes of the preprocessor must not pay for or inherit that.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import struct
import tempfile
from typing import Iterable, Iterator

import numpy as np

from msllm.errors import MsllmError
from msllm.fileio import write_json_atomic

COLUMNS = ("input_ids", "labels")
SCHEMA = {name: {"type": "int32", "shape": [-1]} for name in COLUMNS}
SIDECAR_SUFFIX = ".json"
DB_SUFFIX = ".db"
MINDRECORD_SUFFIX = ".mindrecord"

# Keys of the sidecar X.mindrecord.json written by msllm.data.preprocess (all always present).
SIDECAR_KEYS = (
    "format",          # "msllm-mindrecord-v1"
    "seq_length",      # int: model sequence length; every row holds seq_length + 1 tokens
    "sample_length",   # int: seq_length + 1
    "dataset_type",    # "qa" | "wiki"
    "pad_token_id",    # int: padding id in input_ids
    "ignore_index",    # int: -100, label value excluded from the loss (and label padding)
    "tokenizer_md5",   # hex md5 of the tokenizer file (tokenizer.model or tokenizer.json)
    "tokenizer_file",  # absolute path of that file
    "tokenizer_kind",  # "sentencepiece" | "tokenizer.json"
    "vocab_size",      # int
    "bos_id",          # int
    "eos_id",          # int
    "num_samples",     # int: rows in the MindRecord (after repeat)
    "columns",         # {"input_ids": "int32", "labels": "int32"} (+ "actual_seq_len" when packed)
    "packing",         # --pack: {"rows", "documents", "max_documents_per_row"} (msllm.data.packing); None
    "input_files",     # list of input paths (absolute, sorted)
    "repeat",          # int
    "shuffle",         # bool
    "seed",            # int
    "counts",          # dict: records_read, samples_built, samples_written, tokens_written,
                       #   loss_tokens, truncated, skipped {reason: n}, dropped_tail_tokens,
                       #   not_used_samples_num
    "template",        # prompt template of qa samples (msllm.data.templates; a model's Jinja template is
                       #   "chat_template:<sha256[:12]>"), None for wiki
    "wikitext_files",  # wiki: input files read as WikiText (clean_wikitext paragraphs); None for qa
    "file_partition",  # int: number of shard files of the group (--file_partition)
    "data_files",      # list of the group's data file basenames, in shard order
)
SIDECAR_FORMAT = "msllm-mindrecord-v1"


def sidecar_path(path: str) -> str:
    """Path of the metadata sidecar of the MindRecord ``path`` (``path + ".json"``)."""
    return path + SIDECAR_SUFFIX


def shard_paths(path: str, shard_num: int = 1) -> list[str]:
    """Data file names ``mindspore.mindrecord.FileWriter(path, shard_num)`` writes: ``[path]``
    for one shard, else ``[path + "0", ..., path + str(shard_num - 1)]``."""
    return [path] if shard_num == 1 else [f"{path}{i}" for i in range(shard_num)]


def write_mindrecord(
    path: str,
    rows: Iterable[tuple[np.ndarray, np.ndarray]],
    meta: dict | None = None,
    batch_size: int = 1024,
    description: str = "msllm llama data",
    shard_num: int = 1,
    schema: dict | None = None,
) -> int:
    """Write ``(input_ids, labels)`` rows to the MindRecord ``path`` atomically.

    Args:
        path: output file name (``.mindrecord`` suffix optional); the data files are
            :func:`shard_paths` ``(path, shard_num)``, each with its ``.db`` and, if ``meta`` is
            given, a ``.json`` sidecar (``meta`` plus ``data_files``). Existing files are replaced.
        rows: iterable of pairs of 1-D arrays (converted to int32), one pair per sample.
        meta: JSON-serialisable sidecar content, or ``None`` for no sidecar.
        batch_size: rows per ``FileWriter.write_raw_data`` call.
        description: schema description stored in the header.
        shard_num: ``FileWriter``'s ``shard_num`` (MindFormers' ``--file_partition``), 1..1000.
        schema: other columns than :data:`SCHEMA` (``{name: {"type": "int32"|"float32", "shape": [-1]}}``,
            in row order: each row is then a tuple of that many arrays), e.g. preference pairs
            (:mod:`msllm.data.preference`).

    Returns:
        Number of rows written.

    Raises:
        MsllmError: no rows; a failed write (full disk, unwritable directory). In every
            failure case nothing is left under the final names (see module doc for why a temp
            directory is used).
    """
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    base = os.path.basename(path)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{base}.", suffix=".tmp", dir=parent)
    try:
        return _write_in(tmp_dir, path, base, rows, meta, batch_size, description, shard_num, schema or SCHEMA)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _storage_call(path: str, fn, *args):
    """Call a MindSpore writer method; turn its failure into one MsllmError.

    MindSpore reports a full disk as ``RuntimeError: ... Failed to seekp file.`` inside a
    framework banner; the message says what it most likely is, in one line.
    """
    try:
        return fn(*args)
    except (RuntimeError, OSError) as exc:
        detail = next((ln.strip() for ln in str(exc).splitlines() if "ERROR]" in ln or "Errno" in ln),
                      str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise MsllmError(f"{path}: writing the MindRecord failed ({detail}); is the disk full or "
                         "the directory not writable? Nothing was written.") from None


def _write_in(tmp_dir, path, base, rows, meta, batch_size, description, shard_num, schema) -> int:
    """Write the MindRecord inside ``tmp_dir`` under ``base``, then move it to ``path``."""
    from mindspore.mindrecord import FileWriter

    if not 1 <= shard_num <= 1000:  # FileWriter's own limit
        raise MsllmError(f"--file_partition {shard_num}: expected an integer in [1, 1000]")
    tmp_data = os.path.join(tmp_dir, base)
    writer = _storage_call(path, FileWriter, tmp_data, shard_num, True)
    writer.add_schema(schema, description)
    count = 0
    batch: list[dict] = []
    dtypes = [(name, np.dtype(spec["type"])) for name, spec in schema.items()]
    for row in rows:
        batch.append({name: np.asarray(value, dtype=dt) for (name, dt), value in zip(dtypes, row)})
        if len(batch) >= batch_size:
            _storage_call(path, writer.write_raw_data, batch)
            count += len(batch)
            batch = []
    if batch:
        _storage_call(path, writer.write_raw_data, batch)
        count += len(batch)
    if count == 0:
        raise MsllmError(f"{path}: no samples to write (expected at least one)")
    _storage_call(path, writer.commit)
    finals = shard_paths(path, shard_num)
    temps = shard_paths(tmp_data, shard_num)
    if meta is not None:
        meta = dict(meta, file_partition=shard_num, data_files=[os.path.basename(f) for f in finals])
        for tmp in temps:
            write_json_atomic(tmp + SIDECAR_SUFFIX, meta)
    # Indexes and sidecars first, data files last: a reader given a data file never sees it
    # without its .db (old output is replaced file by file).
    for tmp, final in zip(temps, finals):
        os.replace(tmp + DB_SUFFIX, final + DB_SUFFIX)
        if meta is not None:
            os.replace(tmp + SIDECAR_SUFFIX, sidecar_path(final))
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sidecar_path(final))
    for tmp, final in zip(temps, finals):
        os.replace(tmp, final)
    return count


def read_header(path: str) -> dict:
    """Parse the JSON header of a MindRecord data file without importing MindSpore.

    Format (observed in files written by mindspore 2.10.0 ``FileWriter``): an 8-byte
    little-endian unsigned length ``n`` followed by ``n`` bytes of UTF-8 JSON holding
    ``schema``, ``shard_addresses``, ``page`` ...

    Raises:
        MsllmError: ``path`` is missing or is not a MindRecord data file.
    """
    if not os.path.isfile(path):
        raise MsllmError(f"{path}: MindRecord file not found")
    not_mr = f"{path}: not a MindRecord file (expected a file written by mindspore.mindrecord.FileWriter)"
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise MsllmError(not_mr)
        (size,) = struct.unpack("<Q", head)
        if not 2 <= size <= (64 << 20):
            raise MsllmError(not_mr)
        raw = fh.read(size)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise MsllmError(not_mr) from None
    if not isinstance(header, dict) or "schema" not in header:
        raise MsllmError(not_mr)
    return header


def _check_structure(path: str) -> dict:
    """Header present, .db present, not renamed, schema has our columns; returns the header."""
    header = read_header(path)
    if not os.path.isfile(path + DB_SUFFIX):
        raise MsllmError(
            f"{path}: its index file {path + DB_SUFFIX} is missing (a MindRecord is two files, "
            "X.mindrecord and X.mindrecord.db; copy or move both)"
        )
    addresses = header.get("shard_addresses") or []
    names = {os.path.basename(a) for a in addresses}
    if names and os.path.basename(path) not in names:
        raise MsllmError(
            f"{path}: this MindRecord was written as {sorted(names)[0]!r} and then renamed; "
            "MindSpore looks the shard up by its original name (expected the original file name, "
            "or rerun the preprocessing with the new --output_file)"
        )
    schemas = header.get("schema") or []
    fields = schemas[0].get("schema", {}) if schemas and isinstance(schemas[0], dict) else {}
    for name in COLUMNS:
        if name not in fields:
            raise MsllmError(
                f"{path}: MindRecord has no {name!r} column (columns: {sorted(fields)}); expected "
                "int32 columns 'input_ids' and 'labels' as written by data_preprocess/llama_preprocess.py"
            )
        if fields[name].get("type") != "int32":
            raise MsllmError(
                f"{path}: column {name!r} has type {fields[name].get('type')!r}, expected 'int32'"
            )
    return header


@contextlib.contextmanager
def _reader(path: str) -> Iterator[object]:
    from mindspore.mindrecord import FileReader

    try:
        reader = FileReader(path, num_consumer=1, columns=list(COLUMNS))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise MsllmError(f"{path}: cannot open MindRecord ({str(exc).strip().splitlines()[0]})") from None
    try:
        yield reader
    finally:
        reader.close()


def read_first_sample(path: str) -> tuple[dict, int]:
    """First row of the MindRecord ``path`` (``{"input_ids": int32[L], "labels": int32[L]}``) and
    the number of rows.

    Raises:
        MsllmError: not a readable MindRecord with our columns, or it has no rows.
    """
    _check_structure(path)
    with _reader(path) as reader:
        n = int(reader.len())
        for row in reader.get_next():
            return {k: np.asarray(row[k]) for k in COLUMNS}, n
    raise MsllmError(f"{path}: MindRecord holds no samples (expected at least one)")


def read_mindrecord_arrays(path: str) -> dict[str, np.ndarray]:
    """All rows of the MindRecord ``path`` as int32 arrays of shape ``[num_samples, L]``.

    Meant for tests and inspection of small files (everything is loaded into memory).
    """
    _check_structure(path)
    cols: dict[str, list[np.ndarray]] = {k: [] for k in COLUMNS}
    with _reader(path) as reader:
        for row in reader.get_next():
            for k in COLUMNS:
                cols[k].append(np.asarray(row[k], dtype=np.int32))
    return {k: np.stack(v) if v else np.zeros((0, 0), np.int32) for k, v in cols.items()}


def read_mindrecord_meta(path: str) -> dict:
    """Preprocessing metadata of the MindRecord ``path``.

    Returns the sidecar ``path + ".json"`` (keys :data:`SIDECAR_KEYS`) plus
    ``"meta_source": "sidecar"`` if it exists; otherwise inspects the file and returns
    ``{"seq_length", "sample_length", "num_samples", "meta_source": "first_sample"}`` where
    ``seq_length = len(first input_ids) - 1``.

    Raises:
        MsllmError: the sidecar is not valid JSON or lacks an integer ``seq_length``; or (no
            sidecar) the file is not a readable MindRecord.
    """
    side = sidecar_path(path)
    if os.path.isfile(side):
        try:
            with open(side, "r", encoding="utf-8") as fh:
                meta = json.load(fh)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise MsllmError(f"{side}: invalid metadata sidecar ({exc}); expected JSON written by llama_preprocess.py") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("seq_length"), int):
            raise MsllmError(f"{side}: metadata sidecar has no integer 'seq_length' key")
        meta = dict(meta)
        meta["meta_source"] = "sidecar"
        return meta
    first, n = read_first_sample(path)
    length = int(first["input_ids"].shape[0])
    return {
        "seq_length": length - 1,
        "sample_length": length,
        "num_samples": n,
        "meta_source": "first_sample",
    }


def check_mindrecord(path: str, seq_length: int) -> dict:
    """Check that ``path`` is a usable training MindRecord for a model of ``seq_length``.

    Checks: the data file is a MindRecord, its ``.db`` exists, it was not renamed after writing,
    it has int32 ``input_ids``/``labels`` columns, the first sample (and the sidecar, if any)
    has length ``seq_length + 1`` in both columns, and the sidecar's ``num_samples`` matches.
    A packed file (an ``actual_seq_len`` column, :mod:`msllm.data.packing`) may instead have rows
    of ``seq_length``: MindFormers' packed layout.

    Returns:
        The metadata (see :func:`read_mindrecord_meta`) plus ``"layout"``: ``"rows"`` (one sample
        per row), ``"packed"`` (msllm's packed rows) or ``"mindformers_packed"``.

    Raises:
        MsllmError: naming the file and, for a length mismatch, both lengths.
    """
    expected = seq_length + 1
    first, n = read_first_sample(path)
    packed = "actual_seq_len" in schema_columns(path)
    if packed and all(int(first[name].shape[0]) == seq_length for name in COLUMNS):
        # MindFormers' packed rows: seq_length long, labels shifted (msllm.data.packing.from_mindformers_row)
        expected = seq_length
    for name in COLUMNS:
        got = int(first[name].shape[0])
        if got != expected:
            raise MsllmError(
                f"{path}: samples have {name} length {got} (= seq_length {got - 1} + 1), but the "
                f"model expects seq_length {seq_length} (length {expected}); rerun "
                f"llama_preprocess.py with --seq_length {seq_length} or change the model's seq_length"
            )
    meta = read_mindrecord_meta(path)
    if meta.get("meta_source") == "sidecar":
        side = sidecar_path(path)
        if meta["seq_length"] != seq_length:
            raise MsllmError(
                f"{side}: records seq_length {meta['seq_length']}, but the model expects "
                f"seq_length {seq_length}"
            )
        if isinstance(meta.get("num_samples"), int) and meta["num_samples"] != n:
            raise MsllmError(
                f"{side}: records {meta['num_samples']} samples but {path} holds {n} "
                "(the sidecar belongs to another run; rerun llama_preprocess.py)"
            )
    meta["layout"] = ("mindformers_packed" if expected == seq_length else "packed") if packed else "rows"
    return meta


def schema_columns(path: str) -> list[str]:
    """Column names of the MindRecord ``path`` (from its header)."""
    schemas = read_header(path).get("schema") or []
    return sorted(schemas[0].get("schema", {})) if schemas and isinstance(schemas[0], dict) else []


def _is_data_file(path: str) -> bool:
    """A MindRecord data file: a file with a ``.db`` companion that is not itself a ``.db`` or
    ``.json`` companion."""
    return (os.path.isfile(path) and os.path.isfile(path + DB_SUFFIX)
            and not path.endswith((DB_SUFFIX, SIDECAR_SUFFIX)))


def shard_group(path: str) -> list[str]:
    """All data files of the shard group of the data file ``path`` (absolute, in shard order),
    from its header's ``shard_addresses``, resolved beside it (MindSpore does the same).

    Raises:
        MsllmError: ``path`` is not a MindRecord data file, or a shard of its group is missing.
    """
    header = read_header(path)
    names = [os.path.basename(a) for a in header.get("shard_addresses") or []]
    if len(names) <= 1:
        return [os.path.abspath(path)]
    folder = os.path.dirname(os.path.abspath(path))
    files = [os.path.join(folder, n) for n in names]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise MsllmError(f"{path}: is one of a group of {len(names)} MindRecord shards "
                         f"({', '.join(names)}), but {missing[0]} is missing; keep all shards "
                         "(and their .db files) together")
    return files


def resolve_mindrecord_files(path: str) -> list[str]:
    """The MindRecord data files of a training dataset path.

    Args:
        path: a MindRecord data file (any name, e.g. ``X.mindrecord`` or MindFormers' suffix-less
            ``wiki2048``), one shard of a ``--file_partition`` group (``X.mindrecord0``: the whole
            group is returned, as MindSpore's ``MindDataset`` reads a whole group from one shard
            name), or a directory: every data file in it (recognised by its ``.db`` companion;
            ``.db`` indexes and ``.json`` sidecars are not data files).

    Returns:
        Sorted list of absolute data file paths, each group in shard order, no duplicates.

    Raises:
        MsllmError: path missing; a ``.db``/``.json`` companion given instead of the data file;
            directory without MindRecord data files; a shard of a group missing.
    """
    if not os.path.exists(path):
        raise MsllmError(f"{path}: dataset path not found (expected a .mindrecord file or a directory of them)")
    if os.path.isdir(path):
        candidates = sorted(
            os.path.abspath(p) for p in glob.glob(os.path.join(glob.escape(path), "*")) if _is_data_file(p)
        )
        if not candidates:
            raise MsllmError(f"{path}: directory holds no *.mindrecord files (expected at least one "
                             "MindRecord data file with its .db index)")
        files: list[str] = []
        for f in candidates:
            if f not in files:
                files.extend(g for g in shard_group(f) if g not in files)
        return files
    for suffix in (DB_SUFFIX, SIDECAR_SUFFIX):
        if path.endswith(suffix) and os.path.isfile(path[: -len(suffix)]):
            raise MsllmError(
                f"{path}: is the {suffix} companion of a MindRecord; pass the data file "
                f"{path[: -len(suffix)]} instead"
            )
    if os.path.isfile(path + DB_SUFFIX):
        return shard_group(path)
    return [os.path.abspath(path)]


def check_dataset(path: str, seq_length: int) -> list[str]:
    """:func:`resolve_mindrecord_files` then :func:`check_mindrecord` on each; returns the files."""
    files = resolve_mindrecord_files(path)
    for f in files:
        check_mindrecord(f, seq_length)
    return files

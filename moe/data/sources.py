"""Corpus ingestion: the documents of `data.source`, whatever it is.

The Python standard library's own sources ("stdlib"), a local file or folder (text files cut
into documents of at most `data.doc_max_bytes`, JSONL line by line, JSON and Parquet through
Hugging Face `datasets`), or a Hub dataset id; capped at `data.max_bytes`, hashed in order,
with what was skipped counted and named (`CorpusStats`). moe/data/tokens.py writes them as
token ids.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from moe.errors import InputError

TEXT_SUFFIXES = {".txt", ".md", ".py", ".sql", ".rst"}
TABLE_SUFFIXES = {".json": "json", ".parquet": "parquet"}  # read through HF datasets
DOC_MAX_BYTES = 16_384  # data.doc_max_bytes: a longer text file is cut into documents


@dataclass
class CorpusStats:
    documents: int = 0
    bytes: int = 0
    skipped_undecodable: int = 0
    skipped_records: int = 0  # malformed JSONL lines skipped (data.on_bad_record: skip)
    skipped_files: list[str] = field(default_factory=list)
    sha256: str = ""  # over the documents read, in order


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_documents(stats: CorpusStats) -> Iterator[str]:
    """The Python standard library's own sources (every machine with Python has them)."""
    root = stdlib_root()
    found = []
    # os.walk pruned of installed packages: ~4x faster than Path.rglob over the whole tree
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    files = sorted(Path(f) for f in found)  # Path order, as before: the corpus is unchanged
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library folder {root}")
    for p in files:
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            # e.g. test/encoded_modules/ holds Latin-1 and Shift-JIS sources on purpose.
            stats.skipped_undecodable += 1
            stats.skipped_files.append(str(p.relative_to(root)))
            continue
        yield text


def _file_documents(
    source: Path,
    text_field: str,
    on_bad_record: str,
    stats: CorpusStats,
    encoding: str = "utf-8",
    doc_max_bytes: int = DOC_MAX_BYTES,
) -> Iterator[str]:
    files = sorted(f for f in source.rglob("*") if f.is_file()) if source.is_dir() else [source]
    for f in files:
        suffix = f.suffix.lower()
        if suffix == ".jsonl":
            yield from _jsonl_documents(f, text_field, on_bad_record, stats)
        elif suffix in TABLE_SUFFIXES:
            yield from _hf_documents(TABLE_SUFFIXES[suffix], str(f), text_field)
        elif suffix in TEXT_SUFFIXES:
            problem = _undecodable(f, encoding)
            if problem is None:
                yield from text_file_documents(f, encoding, doc_max_bytes)
            elif source.is_dir():  # one bad file in a folder: skipped, counted and named
                stats.skipped_undecodable += 1
                stats.skipped_files.append(f"{f} ({problem})")
            else:
                raise InputError(f"data.source {f}: {problem}")
        elif not source.is_dir():
            raise InputError(
                f"data.source {source}: unsupported file type {suffix!r}; use .txt/.md/.py, .jsonl/.json or .parquet"
            )


READ_BLOCK = 1 << 20  # text files are read in blocks of this size: memory does not grow with lines


def _undecodable(path: Path, encoding: str) -> str | None:
    """Why `path` cannot be read as `encoding` text (file, byte offset and line), or None.
    A streaming pass, so that a file that fails half-way is refused before any of it is used."""
    decoder = codecs.getincrementaldecoder(encoding)("strict")
    offset, line = 0, 1
    try:
        with open(path, "rb") as fh:
            while block := fh.read(READ_BLOCK):
                try:
                    decoder.decode(block)
                except UnicodeDecodeError as e:
                    at = offset + max(e.start, 0)
                    line += block[: max(e.start, 0)].count(b"\n")
                    return (
                        f"not {encoding} text: undecodable byte at line {line} (byte offset {at});"
                        " set data.encoding to the file's encoding (e.g. latin-1, cp1252) or"
                        " convert it to UTF-8"
                    )
                offset += len(block)
                line += block.count(b"\n")
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return f"not {encoding} text: the file ends inside a character; set data.encoding"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None


def text_file_documents(
    path: Path, encoding: str = "utf-8", doc_max_bytes: int = DOC_MAX_BYTES
) -> Iterator[str]:
    """A text file as documents of at most ~doc_max_bytes characters, read in blocks.

    A file that fits is one document (a source file, a short article). A longer one, such as a
    whole book in one `input.txt`, is cut at paragraph breaks (a blank line) into documents of
    up to doc_max_bytes, so that it splits into train/val/replay; a paragraph longer than that
    is cut at its last line break or space before the limit, and text with neither (one huge
    line) at the limit itself. Memory stays bounded by one block plus one document whatever
    the line lengths."""
    decoder = codecs.getincrementaldecoder(encoding)("strict")
    buf = ""
    with open(path, "rb") as fh:
        while True:
            block = fh.read(READ_BLOCK)
            buf += decoder.decode(block, final=not block)
            while len(buf) > doc_max_bytes:
                cut = _cut(buf, doc_max_bytes)
                yield buf[:cut]
                buf = buf[cut:]
            if not block:
                break
    if buf.strip():
        yield buf


def _cut(text: str, limit: int) -> int:
    """Where to end a document of at most `limit` characters: after the last paragraph break,
    else the last line break, else the last space, else at the limit."""
    for sep in ("\n\n", "\n", " "):
        at = text.rfind(sep, limit // 4, limit)
        if at > 0:
            return at + len(sep)
    return limit


def _jsonl_documents(
    path: Path, text_field: str, on_bad_record: str, stats: CorpusStats
) -> Iterator[str]:
    """One document per JSONL line. Read here rather than through `datasets` so that a bad
    line is reported by number (or skipped and counted) instead of failing the whole file."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
                if not isinstance(row, dict) or text_field not in row:
                    raise KeyError(f"no field {text_field!r} (data.text_field)")
                text = row[text_field]
                if not isinstance(text, str):
                    raise TypeError(f"field {text_field!r} is {type(text).__name__}, not text")
            except (
                ValueError,
                KeyError,
                TypeError,
            ) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                if on_bad_record == "skip":
                    stats.skipped_records += 1
                    continue
                why = e.args[0] if isinstance(e, (KeyError, TypeError)) else f"not valid JSON ({e})"
                raise InputError(
                    f"{path}, line {i}: {why}; fix the line or set data.on_bad_record: skip"
                ) from e
            if text:
                yield text


def _hf_documents(
    builder: str, data_files: str | None, text_field: str, hub_id: str | None = None
) -> Iterator[str]:
    """Rows of a Hugging Face `datasets` source; one document per row's text field."""
    import datasets  # heavy import, only when needed

    datasets.disable_progress_bars()
    try:
        if hub_id is not None:
            ds = datasets.load_dataset(hub_id, split="train", streaming=True)
        else:
            ds = datasets.load_dataset(
                builder, data_files=data_files, split="train", streaming=True
            )
    except Exception as e:  # noqa: BLE001 - datasets raises many types; we re-raise with context
        offline = (
            os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        )
        hint = (
            " (the Hugging Face Hub is offline here: set HF_HUB_OFFLINE=0 where it is reachable)"
            if offline
            else ""
        )
        local = " is no local file or folder, and" if hub_id else ":"
        raise InputError(
            f"data.source {hub_id or data_files}{local} could not load the dataset{hint}: {e}"
        ) from e
    for i, row in enumerate(ds):
        if text_field not in row:
            raise InputError(
                f"data.text_field {text_field!r} is not a column of {hub_id or data_files} (row {i} has {sorted(row)})"
            )
        text = row[text_field]
        if isinstance(text, str) and text:
            yield text


def iter_documents(
    source: str,
    text_field: str,
    max_bytes: int,
    stats: CorpusStats,
    on_bad_record: str = "error",
    encoding: str = "utf-8",
    doc_max_bytes: int = DOC_MAX_BYTES,
) -> Iterator[str]:
    """Documents of `source` ("stdlib", a local file/folder, or a hub dataset id), capped."""
    if source == "stdlib":
        it = _stdlib_documents(stats)
    elif Path(source).exists():
        it = _file_documents(
            Path(source), text_field, on_bad_record, stats, encoding, doc_max_bytes
        )
    elif source.count("/") == 1 and not source.startswith((".", "/", "~")):
        it = _hf_documents("", None, text_field, hub_id=source)
    else:
        raise InputError(
            f"data.source {source!r}: no such file or folder (nor a hub dataset id like owner/name)"
        )
    h = hashlib.sha256()
    try:
        for text in it:
            raw = text.encode("utf-8")
            if max_bytes and stats.bytes + len(raw) > max_bytes and stats.documents:
                break
            h.update(raw)
            h.update(b"\0")
            stats.documents += 1
            stats.bytes += len(raw)
            yield text
    finally:  # also when the reader stops early
        stats.sha256 = h.hexdigest()
    if stats.documents == 0:
        skipped = f"; skipped: {'; '.join(stats.skipped_files[:3])}" if stats.skipped_files else ""
        raise InputError(
            f"data.source {source!r}: no documents with text (read .txt/.md/.py/.sql/.rst,"
            f" .jsonl/.json and .parquet files; {stats.skipped_undecodable} undecodable file(s)"
            f" skipped{skipped})"
        )


def check_source(
    source: str,
    text_field: str = "text",
    on_bad_record: str = "error",
    encoding: str = "utf-8",
    doc_max_bytes: int = DOC_MAX_BYTES,
) -> None:
    """Raise InputError unless `source` yields at least one document: what prepare checks
    before its flow starts (missing, empty, binary-only or unreadable corpora)."""
    if source == "stdlib":
        return
    docs = iter_documents(
        source, text_field, 1, CorpusStats(), on_bad_record, encoding, doc_max_bytes
    )
    try:
        next(docs, None)  # reads up to the first document, or raises naming what is wrong
    finally:
        docs.close()

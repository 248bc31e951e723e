"""The data sections: the corpus and its splits, the SQL pair sets and the databases they run on
(moe/data/sources.py, moe/sql/), and the tokenizer prepare trains or reuses
(moe/data/tokenizer.py).
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moe.config import Problems, knob


@dataclass
class DataConfig:
    # "stdlib" = the Python standard library's sources on this machine; otherwise a local
    # text/JSONL/Parquet file or folder.
    source: str = "stdlib"
    text_field: str = "text"  # the field holding the text in a JSONL or Parquet source
    on_bad_record: Literal["error", "skip"] = (
        "error"  # a malformed JSONL line: stop, or skip and count
    )
    max_bytes: int = knob(4_000_000, ge=0)  # cap on corpus size read (0 = no cap)
    # Text files (.txt/.md/.py/.sql/.rst) are decoded with this codec (any Python codec name:
    # utf-8, latin-1, cp1252, ...); a file that does not decode is named and refused (a lone
    # file) or skipped and listed (in a folder). The stdlib corpus is always UTF-8.
    encoding: str = "utf-8"
    # A text file longer than this (in characters) is cut into documents at paragraph breaks,
    # so that one big file (a book as nanoGPT's input.txt) splits into train/val/replay.
    doc_max_bytes: int = knob(16_384, ge=256)
    val_fraction: float = knob(
        0.05, gt=0.0, lt=0.5
    )  # fraction of documents held out for validation
    replay_fraction: float = knob(
        0.05, ge=0.0, lt=0.5, note=" (0 = no replay split)"
    )  # held back from pretraining for finetune replay
    seed: int = 1337  # shuffles the documents before the validation and replay splits
    # Where prepare writes the token files, the tokenizer and the SQL pairs.
    out_dir: str = "data/prepared"
    # Stage one of finetuning: "generated" (the embedded default: databases built from ten
    # themes, questions generated from their schemas), a folder in Spider's or BIRD's layout,
    # or a JSONL file of {question, sql, db} with db a sqlite path relative to the file.
    sql_generic_source: str = "generated"
    sql_generic_pairs: int = knob(10_000, ge=1)  # at most this many generic training pairs
    # Generic questions never trained on, stratified by kind: half on the training
    # databases, half on databases no training pair uses.
    sql_generic_test_pairs: int = knob(
        200, ge=2, note=" (half on training databases, half on held-out ones)"
    )
    # A folder source: the pair file (by name, without .json) that is the test split
    # (Spider's and BIRD's dev.json); without one, a share of the databases is held out.
    sql_generic_test_split: str = "dev"
    sql_generic_heldout_dbs: float = knob(
        0.2, ge=0, lt=1
    )  # share of a source's databases held out for testing when it has no test split
    # An outside source (a folder or a JSONL file): this many more training pairs written by the
    # generator (moe/sql/generator.py) over its training databases, beside its own pairs; never
    # on a held-out database, and sharing no question or SQL with any test pair.
    sql_generic_generated: int = knob(0, ge=0)
    # How the generator says the questions of stage one's generated pairs: "varied" (each
    # template draws one of its wordings: the formal one that names what the SELECT lists, or
    # plainer ones people write) or "formal" (the first alone, the way Spider's questions are
    # written). What each gave SmolLM2 on held-out Spider: bench/RESULTS.md.
    sql_generic_wordings: str = knob("varied", pattern="varied|formal", note="varied or formal")
    # Stage two: the target domain. A sqlite file of the user's ("" = the embedded default's
    # generated database; only read, never written: the pipeline works on a copy), or a
    # database on a server by SQLAlchemy URL, without a password: postgresql+psycopg://
    # reader@host:5432/shop (pairs are written and checked in its dialect, on the server).
    sql_domain_database: str = ""
    # Where a server database's password comes from: env:NAME (an environment variable) or
    # prefect:BLOCK (a Prefect Secret block); "" = the driver's own (PGPASSWORD, ~/.pgpass).
    sql_domain_password: str = knob(
        "", pattern=r"|env:\w+|prefect:[\w-]+", note="'', env:NAME or prefect:BLOCK"
    )
    # The server's schema (namespace) whose tables the model is taught ("" = the session's
    # current schema, e.g. public).
    sql_domain_schema: str = ""
    sql_domain_views: bool = False  # a server schema's views count as tables too
    # The user's own {question, sql} pairs on that database (JSONL; optional).
    sql_domain_pairs: str = ""
    # The held-out domain questions: a JSONL file of the user's, or a fraction of
    # sql_domain_pairs ("" = 0.3 of them when there are any; else generated ones).
    sql_domain_test: str = ""
    # Domain training pairs: the user's, then pairs generated from the database's own schema
    # and rows up to this many in all.
    sql_domain_train_pairs: int = knob(500, ge=1)
    # How the generator says the domain's generated questions ("varied" or "formal", as
    # sql_generic_wordings). Trained on "varied", SmolLM2 read Chinook's 25 hand-written
    # questions better (bench/RESULTS.md). Both knobs also word the generated test questions;
    # each stage draws from a random stream of its own, so one leaves the other's pairs be.
    sql_domain_wordings: str = knob("varied", pattern="varied|formal", note="varied or formal")
    # Generated held-out domain questions (used when the user gives none).
    sql_domain_test_pairs: int = knob(
        200, ge=1, note=" (generated test questions, when the user gives none)"
    )
    sql_domain_pairs_weight: float = knob(
        3.0, gt=0
    )  # how much more often a user-written pair is drawn than a generated one
    # Up to this many sample values of each categorical column in the schema the model reads
    # (0 = none; dropped first when an example does not fit max_len).
    sql_schema_values: int = knob(0, ge=0, le=30)
    # Up to this many cell values that a question names, shown in its prompt beside their
    # columns (`-- values: customer.country = 'France'`, as BRIDGE and CodeS do), found by
    # the value index of schema pruning (moe/sql/values.py); in training, evaluation and
    # `ask` alike. 0 = none (SmolLM2-135M did not gain from it: bench/RESULTS.md).
    sql_question_values: int = knob(0, ge=0, le=20)
    # An example whose database's whole schema does not fit the model gets the tables and
    # columns its question names (by names and by values the database holds; a training
    # example keeps its gold SQL's tables), recorded with the example. false = shorten the
    # whole schema instead (sample values, then types) and refuse what still does not fit.
    sql_schema_pruning: bool = True
    # Every execution of SQL on the databases (prepare's checks, evaluation, `ask`): a
    # statement running longer or returning more rows counts as failed.
    # Seconds a statement may run before it counts as failed.
    sql_time_limit_s: float = knob(2.0, gt=0)
    # Rows a statement may return before it counts as failed.
    sql_row_limit: int = knob(10_000, ge=1)

    def check(self, p: Problems) -> None:
        try:
            codecs.lookup(self.encoding)
            known = True
        except LookupError:
            known = False
        p.require(known, "encoding", self.encoding, "not a known text encoding (e.g. utf-8)")
        p.require(bool(self.text_field), "text_field", self.text_field, "must not be empty")
        for key in ("sql_domain_database", "sql_domain_pairs"):
            value = getattr(self, key)
            if key == "sql_domain_database" and "://" in value:
                # a server: its URL is a param (dumped, recorded), so it holds no password
                userinfo = value.split("//", 1)[1].split("/", 1)[0].rpartition("@")[0]
                p.require(
                    ":" not in userinfo,
                    key,
                    "(a URL with a password, not shown)",
                    "must not hold a password: remove it and set data.sql_domain_password",
                )
                engine, _, driver = value.split("://", 1)[0].partition("+")
                p.require(
                    ":" in userinfo or (engine == "postgresql" and driver in ("", "psycopg")),
                    key,
                    value,
                    "must be a sqlite file or a PostgreSQL URL (postgresql+psycopg://user@host/db):"
                    " only PostgreSQL has a sandbox here (moe/sql/server.py)",
                )
                continue
            p.require(not value or Path(value).expanduser().is_file(), key, value, "no such file")
        src = self.sql_generic_source
        p.require(
            src == "generated" or Path(src).expanduser().exists(),
            "sql_generic_source",
            src,
            "must be 'generated', a Spider/BIRD folder or a JSONL file that exists",
        )
        p.require(
            src != "generated" or self.sql_generic_generated <= 0,
            "sql_generic_generated",
            self.sql_generic_generated,
            "adds generated pairs to an outside source's own; the embedded default's pairs are"
            " all generated already: raise data.sql_generic_pairs instead, or set 0",
        )
        test = self.sql_domain_test
        try:
            fraction = 0 < float(test) < 1
        except ValueError:
            fraction = False
        p.require(
            not test or fraction or Path(test).expanduser().is_file(),
            "sql_domain_test",
            test,
            "must be a JSONL file that exists or a fraction in (0, 1)",
        )
        p.require(
            not test or not fraction or bool(self.sql_domain_pairs),
            "sql_domain_test",
            test,
            "a fraction of the user's pairs needs data.sql_domain_pairs",
        )


@dataclass
class TokenizerConfig:
    # Byte-level BPE vocabulary trained on the corpus (ignored with tokenizer.path).
    vocab_size: int = knob(
        4096, ge=259, le=1048576, note=": 256 byte tokens + 2 special tokens + at least one merge"
    )
    min_frequency: int = knob(2, ge=1)  # a pair must occur this often to become a merge
    train_bytes: int = knob(
        50_000_000, ge=0, note=" (0 = all)"
    )  # train the BPE on at most this much of the corpus (0 = all)
    path: str = ""  # an existing tokenizer.json to use instead of training one
    # With tokenizer.path (a model's own tokenizer): ask the model in its chat template when
    # it has one (chat_template.jinja beside it), in finetuning, evaluation and `ask` alike.
    chat_template: bool = True

    def check(self, p: Problems) -> None:
        if self.path:
            p.require(
                Path(self.path).is_file(), "path", self.path, "must name an existing tokenizer.json"
            )


# ModelConfig.rope_scaling's keys for rope_type yarn (moe/model/rope.py; truncate as 1 or 0).

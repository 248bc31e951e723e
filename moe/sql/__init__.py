"""Text-to-SQL, one job per module:

- records.py: the pair records (`SqlPair`, `Record`), read from JSONL files and Spider/BIRD
  folders (databases.py `check_records` runs each on its database); `load_pairs` reads a
  prepared set;
- prompts.py: the prompt and response text of an example;
- themes.py: the embedded default's data (the themes its databases are built from);
- sources.py: each source's training and test records (generated, Spider/BIRD/JSONL, the
  user's domain), split so that no test question was trained on;
- fitting.py: the schema text fitted to the model's lengths (`Limits`);
- sets.py: `build_sql_sets`, the five sets a prepare writes;
- schema.py: what a database holds (`Schema`), the text the model reads of it, its fingerprint;
- sandbox.py: a sqlite file's schema, and running predicted SQL on it read-only;
- server.py, reflect.py: the same for a database on a PostgreSQL server, by URL (the schema
  by SQLAlchemy's reflection, the sandbox by the server's own read-only transaction, timeout
  and cursor);
- databases.py: `open_database` for either, and executing every pair before it is kept;
- pruners.py: schema pruning's engine-specific part (the value index, the dialect mark);
- generator.py: questions and SQL generated from a database's own schema and rows;
- evaluate.py: scoring generated SQL by execution.
"""

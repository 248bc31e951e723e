"""Text-to-SQL, one job per module:

- records.py: the pair records (`SqlPair`, `Record`), read from JSONL files and Spider/BIRD
  folders and checked by running them on their databases; `load_pairs` reads a prepared set;
- prompts.py: the prompt and response text of an example;
- themes.py: the embedded default's data (the themes its databases are built from);
- sources.py: each source's training and test records (generated, Spider/BIRD/JSONL, the
  user's domain), split so that no test question was trained on;
- fitting.py: the schema text fitted to the model's lengths (`Limits`);
- sets.py: `build_sql_sets`, the five sets a prepare writes;
- sandbox.py: reading a database's schema, and running predicted SQL read-only;
- generator.py: questions and SQL generated from a database's own schema and rows;
- evaluate.py: scoring generated SQL by execution.
"""

"""Text-to-SQL: pair records and their sources, the generated sets, the database sandbox that
runs predicted SQL read-only, the pair generator, and scoring by execution."""

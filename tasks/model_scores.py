"""The evaluate report's tables of each trained model's scores (tasks/presentation.py
`run_report`): perplexity and SQL accuracy on the held-out sets, per kind of query, per Spider
difficulty level, and how the answers were decoded and scored. They read the metrics only:
the report needs no SQL code, so a SQL edit reruns no stage through this module."""

from __future__ import annotations

from typing import Any


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _decoding_line(metrics: dict[str, Any], trained: list[str]) -> str:
    """How the answers were produced and scored (what a reader needs to compare figures)."""
    d = metrics[trained[-1]]["sql"].get("decoding", {}) if trained else {}
    suite = d.get("test_suite", 0)
    return (
        f"Decoding: greedy, at most {d.get('max_new_tokens', '?')} new tokens, stopping at the"
        " end token or a newline. Scoring as Spider's evaluator: the same rows as the gold"
        " query, as multisets (in order when the gold query's outer ORDER BY orders them),"
        " columns in any order, numbers within 1e-6"
        + (
            f"; test-suite accuracy also on {suite} differently filled copies of each database."
            if suite
            else "."
        )
    )


def model_lines(metrics: dict[str, Any], trained: list[str]) -> list[str]:
    """The report's models: every stage's on the held-out sets, per kind of query, samples.
    The kinds are the ones evaluation reported (in its order): the pipeline report needs no
    SQL code, so a SQL edit reruns no stage through this module."""
    TEMPLATES = list(
        dict.fromkeys(t for s in trained for t in metrics[s]["sql"].get("by_template", {}))
    )
    return [
        "",
        "Domain questions (held out), and generic questions never trained on, on the "
        "databases trained on (seen) and on schemas no training pair uses (held out):",
        "",
        "| model after | val perplexity | valid SQL | execution accuracy | test-suite accuracy "
        "| exact match | generic exec. (seen DBs) | generic exec. (held-out DBs) |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {s} | {metrics[s]['val']['perplexity']:.2f} | {metrics[s]['sql']['valid_sql']:.3f}"
            f" | {metrics[s]['sql']['execution_accuracy']:.3f}"
            f" | {_fmt(metrics[s]['sql'].get('test_suite_accuracy'))}"
            f" | {metrics[s]['sql']['exact_match']:.3f}"
            f" | {_acc(metrics[s], 'generic_seen')} | {_acc(metrics[s], 'generic_heldout')} |"
            for s in trained
        ),
        "",
        "Domain execution accuracy per kind of query:",
        "",
        "| model after | " + " | ".join(TEMPLATES) + " |",
        "|---|" + "---|" * len(TEMPLATES),
        *(
            f"| {s} | "
            + " | ".join(
                f"{b[t]['execution_accuracy']:.2f} ({b[t]['examples']})" if t in b else "-"
                for b in [metrics[s]["sql"]["by_template"]]
                for t in TEMPLATES
            )
            + " |"
            for s in trained
        ),
        *_level_lines(metrics, trained),
        "",
        _decoding_line(metrics, trained),
        "",
        "Exact match compares both queries after sqlglot has parsed and normalised them. "
        "Predicted queries stopped by the execution limits (domain set), each counted wrong: "
        + "; ".join(
            f"{s}: {metrics[s]['sql'].get('timeouts', 0)} over the time limit, "
            f"{metrics[s]['sql'].get('row_limits', 0)} over the row limit, "
            f"{metrics[s]['sql'].get('denied', 0)} denied"
            for s in trained
        )
        + ".",
        "",
        "Samples (the first five, then the first five wrong) after finetune_domain:",
        "",
        *(
            f"- {'ok' if x['execution_match'] else 'WRONG'}: {x['question']}  \n"
            f"  gold `{x['gold']}`  \n  got `{x['predicted']}`"
            for x in metrics["finetune_domain"]["sql"]["samples"]
        ),
    ]


def _level_lines(metrics: dict[str, Any], trained: list[str]) -> list[str]:
    """Execution accuracy per Spider difficulty level of the gold query, on the domain set
    and on the generic set's held-out databases (evaluation's `by_difficulty`)."""
    sets = [n for n in ("sql", "generic_heldout") if any(n in metrics[s] for s in trained)]
    levels = [
        lv
        for lv in ("easy", "medium", "hard", "extra")
        if any(lv in metrics[s].get(n, {}).get("by_difficulty", {}) for s in trained for n in sets)
    ]
    if not levels:
        return []

    def cell(stage: str, level: str) -> str:
        got = []
        for n in sets:
            b = metrics[stage].get(n, {}).get("by_difficulty", {})
            got.append(
                f"{b[level]['execution_accuracy']:.2f} ({b[level]['examples']})"
                if level in b
                else "-"
            )
        return " / ".join(got)

    names = {"sql": "domain", "generic_heldout": "generic on held-out databases"}
    return [
        "",
        "Execution accuracy per Spider difficulty level of the gold query (Spider's rule, "
        f"moe/sql/hardness.py), {' / '.join(names[n] for n in sets)} (questions):",
        "",
        "| model after | " + " | ".join(levels) + " |",
        "|---|" + "---|" * len(levels),
        *(f"| {s} | " + " | ".join(cell(s, lv) for lv in levels) + " |" for s in trained),
    ]


def _acc(stage_metrics: dict[str, Any], name: str) -> str:
    return f"{stage_metrics[name]['execution_accuracy']:.3f}" if name in stage_metrics else "-"

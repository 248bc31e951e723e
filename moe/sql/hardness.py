"""Spider's difficulty levels (easy, medium, hard, extra) of a gold query, by the rule of
Spider's evaluation script (Yu et al. 2018, `Evaluator.eval_hardness`), so that accuracy per
level reads as the peers' tables do (CodeS, DIN-SQL, DB-GPT-Hub report Spider dev by level).

The rule counts, in the outermost query only:
- components 1: WHERE, GROUP BY, ORDER BY, LIMIT, each join, each OR and each LIKE in the
  join, WHERE and HAVING conditions;
- components 2: the nested queries (a subquery in those conditions, and one for a UNION,
  INTERSECT or EXCEPT);
- others: more than one aggregate, more than one selected column, more than one WHERE
  condition, more than one GROUP BY column. As the original counts them, a NOT in a WHERE
  or HAVING condition and each AND/OR joining HAVING conditions count as aggregates (its
  `has_agg` reads the first field of a condition, which is its NOT flag).

Spider's own script needs the database schema to parse a query; this reads it with sqlglot and
needs none. bench/scoring_agreement.py holds it against the original's level for every
query of Spider's dev split.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from moe.sql.sandbox import parse_sql

LEVELS = ("easy", "medium", "hard", "extra")


@dataclass(frozen=True)
class Counts:
    """The three counts Spider's rule reads."""

    components1: int
    components2: int
    others: int

    @property
    def level(self) -> str:
        c1, c2, o = self.components1, self.components2, self.others
        if c1 <= 1 and o == 0 and c2 == 0:
            return "easy"
        if (o <= 2 and c1 <= 1 and c2 == 0) or (c1 <= 2 and o < 2 and c2 == 0):
            return "medium"
        if (
            (o > 2 and c1 <= 2 and c2 == 0)
            or (2 < c1 <= 3 and o <= 2 and c2 == 0)
            or (c1 <= 1 and o == 0 and c2 <= 1)
        ):
            return "hard"
        return "extra"


def hardness(sql: str, dialect: str = "sqlite") -> str:
    """Spider's difficulty level of `sql`, read in `dialect` ("extra" for a query sqlglot
    cannot parse, as the hardest is what an unreadable query most likely is; Spider's script
    raises)."""
    got = counts(sql, dialect)
    return got.level if got is not None else "extra"


@lru_cache(maxsize=4096)
def counts(sql: str, dialect: str = "sqlite") -> Counts | None:
    """The counts of Spider's rule for `sql`, or None where sqlglot cannot parse it."""
    from sqlglot import exp

    tree = parse_sql(sql, dialect)
    if tree is None:
        return None
    nested = 0
    while isinstance(tree, exp.Subquery):  # "(SELECT ...)" as a whole query
        tree = tree.this
    if isinstance(tree, exp.SetOperation):  # the left query is the outer one; the rest nests
        nested += 1
        while isinstance(tree, exp.SetOperation):
            tree = tree.left
            while isinstance(tree, exp.Subquery):
                tree = tree.this
    if not isinstance(tree, exp.Select):
        return None

    def own(node: exp.Expression, kind: type[exp.Expression]) -> list[exp.Expression]:
        """The `kind` nodes of `node` outside any subquery (the outer query's own)."""
        found = []
        stack = [node]
        while stack:
            n = stack.pop()
            if isinstance(n, kind):
                found.append(n)
            if n is not node and isinstance(n, exp.Query):
                continue
            stack.extend(n.iter_expressions())
        return found

    def subqueries(node: exp.Expression) -> int:
        return len(own(node, exp.Query)) - (1 if isinstance(node, exp.Query) else 0)

    def conjuncts(node: exp.Expression | None) -> int:
        """The conditions of a WHERE or HAVING as Spider lists them (AND/OR split)."""
        if node is None:
            return 0
        return 1 + len(own(node, exp.Connector))

    where = tree.args.get("where")
    having = tree.args.get("having")
    group = tree.args.get("group")
    order = tree.args.get("order")
    joins = tree.args.get("joins") or []
    conditions = [c for c in (where, having, *(j.args.get("on") for j in joins)) if c]

    c1 = sum(x is not None for x in (where, group, order, tree.args.get("limit")))
    c1 += len(joins)
    for cond in conditions:
        c1 += len(own(cond, exp.Or)) + len(own(cond, exp.Like))
    nested += sum(subqueries(cond) for cond in conditions)

    def has_agg(node: exp.Expression) -> bool:
        return bool(own(node, exp.AggFunc))

    selected = tree.expressions
    aggs = sum(has_agg(e) for e in selected)
    aggs += len(own(where, exp.Not)) if where else 0
    aggs += sum(has_agg(g) for g in (group.expressions if group else []))
    aggs += sum(has_agg(o) for o in (order.expressions if order else []))
    if having is not None:
        aggs += len(own(having, exp.Not)) + len(own(having, exp.Connector))
    others = int(aggs > 1) + int(len(selected) > 1) + int(conjuncts(where) > 1)
    others += int(len(group.expressions) > 1 if group else 0)
    return Counts(c1, nested, others)

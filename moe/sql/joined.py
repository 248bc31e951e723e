"""The question generator's `joins` templates (moe/sql/generator.py): across a foreign key,
filtered, grouped or aggregated, and by a parent's or a child's name."""

from __future__ import annotations

import random

from moe.sql.roles import AGGS, Role, Tables, article, literal
from moe.sql.sandbox import ident


class Joins(Tables):
    """The `joins` templates: across a foreign key."""

    def _j_names(self, rng: random.Random) -> tuple[str, str] | None:
        j = self._join(rng)
        if not j or not j[0].cats:
            return None
        child, _, parent, _, on = j
        c = rng.choice(child.cats)
        v = self._cat_value(c, rng)
        return (
            self._say(
                rng,
                f"List the {self._lbl(parent)} of {parent.nouns} that have {article(child.noun)} with {self._words(c.name)} {v}.",
                f"Which {parent.nouns} have {article(child.noun)} with {self._words(c.name)} {v}?",
            ),
            f"SELECT DISTINCT {self._sel(parent, 'T1.')} FROM {on} WHERE T2.{ident(c.name)} = {literal(v)}",
        )

    def _j_count(self, rng: random.Random) -> tuple[str, str] | None:
        j = self._join(rng)
        if not j:
            return None
        child, _, parent, pcol, on = j
        return (
            self._say(
                rng,
                f"How many {child.nouns} does each {parent.noun} have? Show the {parent.label_words} and count.",
                f"How many {child.nouns} does each {parent.noun} have?",
                f"Count the {child.nouns} of each {parent.noun}.",
            ),
            f"SELECT {self._sel(parent, 'T1.')}, COUNT(*) FROM {on} GROUP BY T1.{ident(pcol)}",
        )

    def _j_agg(self, rng: random.Random) -> tuple[str, str] | None:
        j = self._join(rng)
        if not j or not j[0].nums or not j[2].cats:
            return None
        child, _, parent, _, on = j
        n, c = rng.choice(child.nums), rng.choice(parent.cats)
        agg, agg_w = rng.choice(AGGS)
        v = self._cat_value(c, rng)
        return (
            self._say(
                rng,
                f"What is the {agg_w} {self._words(n.name)} of {child.nouns} for {parent.nouns} whose {self._words(c.name)} is {v}?",
                f"What is the {agg_w} {child.noun} {self._words(n.name)} for {parent.nouns} with {self._words(c.name)} {v}?",
            ),
            f"SELECT {agg}(T2.{ident(n.name)}) FROM {on} WHERE T1.{ident(c.name)} = {literal(v)}",
        )

    def _j_child(self, rng: random.Random) -> tuple[str, str] | None:
        j = self._join(rng)
        if not j or not j[2].cats:
            return None
        child, _, parent, _, on = j
        c = rng.choice(parent.cats)
        v = self._cat_value(c, rng)
        return (
            self._say(
                rng,
                f"List the {self._lbl(child)} of {child.nouns} whose {parent.noun} has {self._words(c.name)} {v}.",
                f"Which {child.nouns} have {article(parent.noun)} with {self._words(c.name)} {v}?",
            ),
            f"SELECT {self._sel(child, 'T2.')} FROM {on} WHERE T1.{ident(c.name)} = {literal(v)}",
        )

    def _j_num(self, rng: random.Random) -> tuple[str, str] | None:
        j = self._join(rng)
        if not j or not j[2].nums:
            return None
        child, _, parent, _, on = j
        n = rng.choice(parent.nums)
        op, op_w = self._op(rng)
        x = self._num_value(n, rng)
        return (
            self._say(
                rng,
                f"How many {child.nouns} belong to {parent.nouns} with {self._words(n.name)} {op_w} {x}?",
                f"Count the {child.nouns} of {parent.nouns} whose {self._words(n.name)} is {op_w} {x}.",
            ),
            f"SELECT COUNT(*) FROM {on} WHERE T1.{ident(n.name)} {op} {literal(x)}",
        )

    def _named_join(self, rng: random.Random, side: int) -> tuple[Role, str, Role, str, str] | None:
        """A join whose parent (`side` 2) or child (`side` 0) has a name to quote."""
        j = self._join(rng)
        return j if j and j[side].named else None

    def _j_of_parent(self, rng: random.Random) -> tuple[str, str] | None:
        j = self._named_join(rng, 2)
        if not j:
            return None
        child, _, parent, _, on = j
        v = self._any_value(parent.label, rng)
        return (
            self._say(
                rng,
                f"List the {self._lbl(child)} of the {child.nouns} of the {parent.noun} {v}.",
                f"List the {child.nouns} of the {parent.noun} {v}.",
                f"Which {child.nouns} does the {parent.noun} {v} have?",
            ),
            f"SELECT {self._sel(child, 'T2.')} FROM {on} WHERE T1.{ident(parent.label.name)} = {literal(v)}",
        )

    def _j_parent_of(self, rng: random.Random) -> tuple[str, str] | None:
        j = self._named_join(rng, 0)
        if not j:
            return None
        child, _, parent, _, on = j
        v = self._any_value(child.label, rng)
        return (
            self._say(
                rng,
                f"Which {parent.noun} has the {child.noun} {v}? Give its {parent.label_words}.",
                f"Which {parent.noun} has the {child.noun} {v}?",
                f"What is the {parent.noun} of the {child.noun} {v}?",
            ),
            f"SELECT {self._sel(parent, 'T1.')} FROM {on} WHERE T2.{ident(child.label.name)} = {literal(v)}",
        )

    def _j_count_in(self, rng: random.Random) -> tuple[str, str] | None:
        j = self._named_join(rng, 2)
        if not j:
            return None
        child, _, parent, _, on = j
        v = self._any_value(parent.label, rng)
        return (
            self._say(
                rng,
                f"How many {child.nouns} does the {parent.noun} {v} have?",
                f"How many {child.nouns} are there for the {parent.noun} {v}?",
            ),
            f"SELECT COUNT(*) FROM {on} WHERE T1.{ident(parent.label.name)} = {literal(v)}",
        )

    def _j_agg_in(self, rng: random.Random) -> tuple[str, str] | None:
        j = self._named_join(rng, 2)
        if not j or not j[0].nums:
            return None
        child, _, parent, _, on = j
        n, v = rng.choice(child.nums), self._any_value(parent.label, rng)
        agg, agg_w = rng.choice(AGGS)
        return (
            self._say(
                rng,
                f"What is the {agg_w} {self._words(n.name)} of the {child.nouns} of the {parent.noun} {v}?",
                f"What is the {agg_w} {child.noun} {self._words(n.name)} of the {parent.noun} {v}?",
            ),
            f"SELECT {agg}(T2.{ident(n.name)}) FROM {on} WHERE T1.{ident(parent.label.name)} = {literal(v)}",
        )

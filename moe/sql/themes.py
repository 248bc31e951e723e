"""The embedded default's data: the themes its databases are built from (twelve generic ones,
the last `HELD_OUT_THEMES` of them never trained on, and the domain's), and the syllables of
the random names in their rows. Declarations only: moe/sql/sources.py builds the databases.
"""

from __future__ import annotations

# A theme: a parent table and a child table that references it:
# (table, category column, its values, number columns with ranges)
ThemeTable = tuple[str, str, list[str], list[tuple[str, int, int]]]
Theme = tuple[ThemeTable, ThemeTable]

HELD_OUT_THEMES = 2  # the last generic themes: schemas no training pair uses

GENERIC_THEMES: list[Theme] = [
    (
        (
            "singer",
            "country",
            ["France", "Japan", "Brazil", "Kenya", "Canada"],
            [("age", 18, 70), ("net_worth", 1, 900)],
        ),
        (
            "concert",
            "venue",
            ["Arena", "Stadium", "Club", "Hall"],
            [("year", 1990, 2024), ("attendance", 100, 90000)],
        ),
    ),
    (
        (
            "author",
            "genre",
            ["poetry", "fiction", "history", "science"],
            [("birth_year", 1900, 2000), ("awards", 0, 12)],
        ),
        (
            "book",
            "format",
            ["hardcover", "paperback", "ebook"],
            [("pages", 50, 1200), ("price", 5, 90)],
        ),
    ),
    (
        (
            "team",
            "city",
            ["Lyon", "Osaka", "Lima", "Oslo", "Perth"],
            [("founded", 1880, 2010), ("budget", 1, 500)],
        ),
        (
            "player",
            "position",
            ["goalkeeper", "defender", "midfielder", "forward"],
            [("age", 17, 40), ("goals", 0, 300)],
        ),
    ),
    (
        (
            "store",
            "region",
            ["north", "south", "east", "west"],
            [("size", 100, 5000), ("staff", 2, 80)],
        ),
        (
            "sale",
            "category",
            ["food", "toys", "tools", "books"],
            [("amount", 1, 2000), ("quantity", 1, 50)],
        ),
    ),
    (
        (
            "airline",
            "country",
            ["Chile", "Italy", "India", "Egypt"],
            [("fleet_size", 5, 900), ("founded", 1920, 2015)],
        ),
        (
            "flight",
            "destination",
            ["Rome", "Delhi", "Cairo", "Quito", "Seoul"],
            [("distance", 200, 14000), ("delay", 0, 300)],
        ),
    ),
    (
        (
            "school",
            "district",
            ["A", "B", "C", "D"],
            [("students", 100, 4000), ("founded", 1850, 2020)],
        ),
        (
            "teacher",
            "subject",
            ["math", "art", "music", "biology"],
            [("salary", 30, 120), ("experience", 0, 40)],
        ),
    ),
    (
        (
            "farm",
            "state",
            ["Iowa", "Texas", "Ohio", "Utah"],
            [("acres", 10, 9000), ("workers", 1, 120)],
        ),
        (
            "crop",
            "kind",
            ["wheat", "corn", "soy", "rice"],
            [("yield", 1, 400), ("harvest_year", 2000, 2024)],
        ),
    ),
    (
        (
            "museum",
            "city",
            ["Paris", "Berlin", "Madrid", "Vienna"],
            [("opened", 1750, 2020), ("visitors", 1000, 900000)],
        ),
        (
            "exhibit",
            "theme",
            ["modern", "ancient", "nature", "space"],
            [("pieces", 3, 400), ("duration_days", 7, 365)],
        ),
    ),
    (
        (
            "company",
            "industry",
            ["energy", "retail", "software", "banking"],
            [("employees", 5, 90000), ("revenue", 1, 999)],
        ),
        (
            "product",
            "line",
            ["basic", "pro", "premium"],
            [("price", 1, 3000), ("units_sold", 0, 100000)],
        ),
    ),
    (
        (
            "gym",
            "chain",
            ["FitOne", "CoreLab", "IronBox"],
            [("members", 50, 6000), ("opened", 1990, 2024)],
        ),
        (
            "trainer",
            "specialty",
            ["yoga", "boxing", "cycling", "weights"],
            [("age", 20, 65), ("sessions", 0, 900)],
        ),
    ),
    (
        (
            "planet",
            "system",
            ["Sol", "Kepler", "Gliese", "Trappist"],
            [("moons", 0, 80), ("radius", 1, 70000)],
        ),
        (
            "probe",
            "agency",
            ["NASA", "ESA", "JAXA", "ISRO"],
            [("launch_year", 1960, 2024), ("mass", 100, 6000)],
        ),
    ),
    (
        (
            "restaurant",
            "cuisine",
            ["thai", "mexican", "french", "greek"],
            [("rating", 1, 5), ("seats", 10, 300)],
        ),
        (
            "dish",
            "course",
            ["starter", "main", "dessert"],
            [("price", 3, 80), ("calories", 50, 1800)],
        ),
    ),
]

DOMAIN_THEME: Theme = (
    (
        "doctor",
        "department",
        ["cardiology", "oncology", "pediatrics", "neurology", "surgery"],
        [("experience", 1, 40), ("age", 28, 70)],
    ),
    (
        "appointment",
        "ward",
        ["east", "west", "north", "south", "icu"],
        [("cost", 20, 900), ("duration", 10, 120)],
    ),
)


SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ra",
    "to",
    "ne",
    "su",
    "vi",
    "da",
    "pe",
    "zo",
    "li",
    "mo",
    "ta",
    "re",
]

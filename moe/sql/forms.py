"""Whether a question names a value, in the forms questions use: "French singers" names
'France', "American customers" names 'USA', "comedies" names 'Comedy' (moe/sql/grounding.py).

A value is named when each of its words matches a word of the question: the same word (case
aside: both are compared as the value index compares them, `phrase`), the same after a plural
ending is taken off ("singers", "countries", "boxes"), or the value word of 4+ letters starts
the question's word ("Rock" in "rockers"). A country matches its other names, codes and
demonyms from `COUNTRIES`, a table of ours (no gazetteer package holds demonyms).

What it does not match: abbreviations outside the table ("NY" for 'New York'; "US" is left
out, a word of its own in "tell us"), other languages' names ("Espana"), misspellings, and
numbers written as words ("two" for '2'). It matches too much where a value's words stand
apart in the question, in any order: each word is matched on its own.
"""

from __future__ import annotations

from moe.sql.pruning import phrase

# Each line: the forms of one country that questions and databases use interchangeably.
COUNTRIES = """
usa|united states|united states of america|america|american|americans
uk|united kingdom|great britain|britain|british|england
france|french|germany|german|deutschland|italy|italian|spain|spanish|canada|canadian
brazil|brazilian|mexico|mexican|japan|japanese|china|chinese|india|indian
australia|australian|netherlands|the netherlands|holland|dutch|belgium|belgian
sweden|swedish|norway|norwegian|denmark|danish|finland|finnish|poland|polish
portugal|portuguese|ireland|irish|austria|austrian|switzerland|swiss|russia|russian
argentina|argentinian|argentine|chile|chilean|czech republic|czechia|czech
hungary|hungarian|greece|greek|turkey|turkish|south korea|korea|korean|egypt|egyptian
south africa|south african|new zealand|new zealander|scotland|scottish|wales|welsh
colombia|colombian|peru|peruvian|israel|israeli|iran|iranian|thailand|thai
vietnam|vietnamese|indonesia|indonesian|philippines|filipino|nigeria|nigerian
kenya|kenyan|ukraine|ukrainian|romania|romanian|bulgaria|bulgarian|croatia|croatian
serbia|serbian|slovakia|slovak|slovenia|slovenian|pakistan|pakistani|cuba|cuban
jamaica|jamaican|iceland|icelandic|morocco|moroccan|saudi arabia|saudi
singapore|singaporean|malaysia|malaysian|venezuela|venezuelan|uruguay|uruguayan
ecuador|ecuadorian|bolivia|bolivian|paraguay|paraguayan|qatar|qatari
united arab emirates|uae|emirati|estonia|estonian|latvia|latvian|lithuania|lithuanian
"""
# Lines hold several countries, each a run of its forms: split where a new country starts.
_STARTS = {
    "france", "germany", "italy", "spain", "canada", "brazil", "mexico", "japan", "china",
    "india", "australia", "belgium", "sweden", "norway", "denmark", "finland", "poland",
    "portugal", "ireland", "austria", "switzerland", "russia", "argentina", "chile",
    "czech republic", "hungary", "greece", "turkey", "south korea", "egypt", "south africa",
    "new zealand", "scotland", "wales", "colombia", "peru", "israel", "iran", "thailand",
    "vietnam", "indonesia", "philippines", "nigeria", "kenya", "ukraine", "romania",
    "bulgaria", "croatia", "serbia", "slovakia", "slovenia", "pakistan", "cuba", "jamaica",
    "iceland", "morocco", "saudi arabia", "singapore", "malaysia", "venezuela", "uruguay",
    "ecuador", "bolivia", "paraguay", "qatar", "united arab emirates", "estonia", "latvia",
    "lithuania", "usa", "uk", "netherlands",
}  # fmt: skip


def _forms() -> dict[str, frozenset[str]]:
    """Each form of a country: the set of that country's forms."""
    out: dict[str, frozenset[str]] = {}
    for line in COUNTRIES.strip().splitlines():
        group: list[str] = []
        for form in [*line.split("|"), ""]:
            if (form in _STARTS or not form) and group:
                out |= dict.fromkeys(group, frozenset(group))
                group = []
            if form:
                group.append(form)
    return out


FORMS = _forms()


def words(text: str) -> list[str]:
    """The lower-case words of `text`, as the value index compares them (`phrase`)."""
    return phrase(text).split()


def _stem(word: str) -> str:
    """A plural's singular, roughly: countries -> country, boxes -> box, singers -> singer."""
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 4 and word.endswith(("ses", "xes", "zes", "ches", "shes")):
        return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    return word


def _word_named(value_word: str, asked: list[str]) -> bool:
    stem = _stem(value_word)
    for q in asked:
        if q == value_word or _stem(q) == stem:
            return True
        if len(value_word) >= 4 and q.startswith(value_word):
            return True
    return False


def named_in(value: str, question: str) -> bool:
    """Whether `question` names `value` (the module says in which forms)."""
    vw, asked = words(value), words(question)
    if not vw:
        return False
    if all(_word_named(w, asked) for w in vw):
        return True
    said = " " + " ".join(asked) + " "
    forms = FORMS.get(" ".join(vw), frozenset())
    return any(f" {form} " in said for form in forms)

"""The fictional world behind the knowledge base: countries, cities, people, organisations and works.

Invariant: everything is drawn from one `random.Random(seed)` in a fixed order over lists (never over
sets or dict orderings that depend on hashing), so a seed always yields the same world; entity names
are unique after SQuAD normalisation, so every question names exactly one entity. Look-alike names
(a changed letter, a shared surname, a shared organisation core) are generated on purpose as
retrieval distractors.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass, field

from tandemrl.data.kb_vocab import (
    CITY_PREFIXES,
    CITY_SUFFIXES,
    CODAS,
    COUNTRY_FORMS,
    COUNTRY_SUFFIXES,
    GENRES,
    INDUSTRIES,
    INNER_CODAS,
    OCCUPATIONS,
    ONSETS,
    ORG_SUFFIXES,
    ORG_WORDS,
    TITLE_ADJS,
    TITLE_NOUNS,
    VOWELS,
    WORK_KINDS,
)


def normalize(text: str) -> str:
    """SQuAD normalisation (lowercase, no punctuation, no articles, single spaces) — the reward's."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


@dataclass
class Entity:
    """One entity; `facts` maps a fact kind to a value: an entity id for relations, else str or int."""

    entity_id: str
    kind: str  # country | city | person | org | work
    name: str
    facts: dict[str, str | int] = field(default_factory=dict)
    aliases: list[str] = field(default_factory=list)  # other names that count as the same answer
    detail: dict[str, str] = field(default_factory=dict)  # non-fact flavour: pronoun, work kind, ...


class NameBook:
    """Hands out names that are unique after normalisation (case, punctuation, articles)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()  # membership only, never iterated: order cannot leak

    def syllables(self, count: int) -> str:
        codas = [INNER_CODAS] * (count - 1) + [CODAS]
        parts = [self.rng.choice(ONSETS) + self.rng.choice(VOWELS) + self.rng.choice(coda) for coda in codas]
        return "".join(parts).capitalize()

    def claim(self, name: str) -> bool:
        key = normalize(name)
        if not key or key in self.used:
            return False
        self.used.add(key)
        return True

    def fresh(self, make) -> str:
        for _ in range(1000):
            name = make()
            if self.claim(name):
                return name
        # build_world's MAX_ENTITIES keeps every name space far from full; reaching this is a generator bug
        raise ValueError("the knowledge-base generator ran out of unique names; lower --num-entities.")

    def is_taken(self, name: str) -> bool:
        return normalize(name) in self.used


def mutate(word: str, rng: random.Random) -> str:
    """A look-alike: one vowel swapped or one letter doubled/added (Holt → Hult, Holtt, Holte)."""
    vowels = [i for i, ch in enumerate(word) if ch in "aeiou"]
    choice = rng.randrange(3)
    if choice == 0 and vowels:
        i = rng.choice(vowels)
        return word[:i] + rng.choice([v for v in "aeiou" if v != word[i]]) + word[i + 1 :]
    if choice == 1:
        return word + rng.choice(["e", "s", "a", "en"])
    i = rng.randrange(1, len(word))
    return word[:i] + word[i - 1] + word[i:]


MIN_ENTITIES = 20  # every kind needs a few entities for relations and look-alikes
# Entity ids are numbered with five digits per kind ("person-00042"; people are 52% of the budget), and at
# this size a KB takes about 35 s and 0.6 GiB to generate on one CPU core (the default 5,000: about 4 s);
# past it the generation time and memory grow with no new kind of question (the splits stay 20,000/500/500).
MAX_ENTITIES = 100_000


def check_num_entities(num_entities: int) -> None:
    """Refuse an entity budget the generator cannot turn into a knowledge base."""
    if num_entities < MIN_ENTITIES:
        raise ValueError(
            f"num_entities={num_entities} is too small for a knowledge base; use at least {MIN_ENTITIES}."
        )
    if num_entities > MAX_ENTITIES:
        raise ValueError(
            f"num_entities={num_entities} is over the generator's limit of {MAX_ENTITIES:,} entities (ids have "
            f"five digits per kind; {MAX_ENTITIES:,} takes about 35 s and 0.6 GiB); use at most {MAX_ENTITIES}."
        )


def entity_counts(num_entities: int) -> dict[str, int]:
    """Split the entity budget over kinds; people dominate, as in an encyclopedia."""
    shares = {"country": 0.008, "city": 0.11, "person": 0.52, "org": 0.17}
    counts = {kind: max(2, round(num_entities * share)) for kind, share in shares.items()}
    counts["work"] = max(2, num_entities - sum(counts.values()))
    return counts


def _make_countries(book: NameBook, num: int) -> list[Entity]:
    rng = book.rng
    countries = []
    for i in range(num):
        name = book.fresh(lambda: book.syllables(rng.choice([1, 2])) + rng.choice(COUNTRY_SUFFIXES))
        form = f"{rng.choice(COUNTRY_FORMS)} of {name}"
        book.claim(form)
        countries.append(Entity(f"country-{i:05d}", "country", name, aliases=[form]))
    return countries


def _city_name(book: NameBook, cities: list[Entity]) -> str:
    rng = book.rng
    if len(cities) >= 20 and rng.random() < 0.12:  # look-alike of an existing city
        base = rng.choice(cities).name.split()[-1]
        return book.fresh(lambda: mutate(base, rng))
    pattern = rng.randrange(3)
    if pattern == 0:
        return book.fresh(lambda: book.syllables(2))
    if pattern == 1:
        return book.fresh(lambda: book.syllables(1) + rng.choice(CITY_SUFFIXES))
    return book.fresh(lambda: f"{rng.choice(CITY_PREFIXES)} {book.syllables(2)}")


def _make_cities(book: NameBook, num: int, countries: list[Entity]) -> list[Entity]:
    rng = book.rng
    cities: list[Entity] = []
    for i in range(num):
        # the first cities go round-robin so that every country has one (its capital)
        country = countries[i] if i < len(countries) else rng.choice(countries)
        city = Entity(
            f"city-{i:05d}",
            "city",
            _city_name(book, cities),
            facts={"country": country.entity_id, "founded_year": rng.randint(820, 1860)},
        )
        if i < len(countries):
            country.facts["capital"] = city.entity_id
        cities.append(city)
    return cities


def _person_name(book: NameBook, people: list[Entity], first_names: list[str]) -> str:
    rng = book.rng
    roll = rng.random()
    if len(people) >= 20 and roll < 0.12:  # same first name, look-alike surname
        first, last = rng.choice(people).name.split(" ", 1)
        return book.fresh(lambda: f"{first} {mutate(last, rng)}")
    if len(people) >= 20 and roll < 0.2:  # same surname, other first name
        last = rng.choice(people).name.split(" ", 1)[1]
        return book.fresh(lambda: f"{rng.choice(first_names)} {last}")
    return book.fresh(lambda: f"{rng.choice(first_names)} {book.syllables(rng.choice([2, 2, 3]))}")


def _make_people(book: NameBook, num: int, cities: list[Entity]) -> list[Entity]:
    rng = book.rng
    first_names = [book.syllables(rng.choice([1, 2])) for _ in range(max(50, num // 6))]
    people: list[Entity] = []
    for i in range(num):
        person = Entity(
            f"person-{i:05d}",
            "person",
            _person_name(book, people, first_names),
            facts={
                "born_in": rng.choice(cities).entity_id,
                "birth_year": rng.randint(1820, 1990),
                "occupation": rng.choice(OCCUPATIONS),
            },
            detail={"pronoun": rng.choice(["he", "she"])},
        )
        people.append(person)
    return people


def _make_orgs(book: NameBook, num: int, people: list[Entity], cities: list[Entity]) -> list[Entity]:
    rng = book.rng
    orgs: list[Entity] = []
    cores: list[str] = []
    for i in range(num):
        if len(orgs) >= 20 and rng.random() < 0.12:  # same core, other suffix: "Amber Works" vs "Amber Trust"
            core = rng.choice(cores)
        else:
            core = rng.choice(ORG_WORDS) if rng.random() < 0.35 else book.syllables(2)
            core = f"{core} {rng.choice(ORG_WORDS)}" if rng.random() < 0.2 else core
        # a popular core can hold every suffix already (the look-alike draw favours popular cores): it then
        # gets a new core; a core with a suffix left draws exactly as before, so existing KBs are unchanged
        while all(book.is_taken(f"{core} {suffix}") for suffix in ORG_SUFFIXES):
            core = book.syllables(2)
        name = book.fresh(lambda core=core: f"{core} {rng.choice(ORG_SUFFIXES)}")
        founder = rng.choice(people)
        year = min(2020, int(founder.facts["birth_year"]) + rng.randint(22, 60))
        orgs.append(
            Entity(
                f"org-{i:05d}",
                "org",
                name,
                facts={
                    "founded_by": founder.entity_id,
                    "led_by": rng.choice(people).entity_id,
                    "headquarters": rng.choice(cities).entity_id,
                    "founded_year": year,
                    "industry": rng.choice(INDUSTRIES),
                },
            )
        )
        cores.append(core)
    # the bare core is an alias only where it names nothing else
    for org, core in zip(orgs, cores, strict=True):
        if cores.count(core) == 1 and book.claim(core):
            org.aliases.append(core)
    return orgs


def plural(noun: str) -> str:
    if noun.endswith("y") and noun[-2:-1] not in tuple("aeiou"):
        return noun[:-1] + "ies"
    return noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")


def _work_title(book: NameBook) -> str:
    rng = book.rng
    adj, noun, noun2 = rng.choice(TITLE_ADJS), rng.choice(TITLE_NOUNS), rng.choice(TITLE_NOUNS)
    patterns = [
        f"The {adj} {noun}",
        f"The {noun} of {book.syllables(2)}",
        f"{adj} {plural(noun)}",
        f"The {noun} and the {noun2}",
        f"{book.syllables(2)}'s {noun}",
        f"{adj} {noun} of {plural(noun2)}",
    ]
    return rng.choice(patterns)


def _make_works(book: NameBook, num: int, people: list[Entity], orgs: list[Entity]) -> list[Entity]:
    rng = book.rng
    works = []
    for i in range(num):
        kind = rng.choice(WORK_KINDS)
        creator = rng.choice(people)
        works.append(
            Entity(
                f"work-{i:05d}",
                "work",
                book.fresh(lambda: _work_title(book)),
                facts={
                    "creator": creator.entity_id,
                    "year": min(2024, int(creator.facts["birth_year"]) + rng.randint(18, 70)),
                    "publisher": rng.choice(orgs).entity_id,
                    "genre": rng.choice(GENRES[kind]),
                },
                detail={"work_kind": kind},
            )
        )
    return works


def build_world(seed: int, num_entities: int) -> dict[str, Entity]:
    """All entities by id, in a fixed generation order (countries, cities, people, orgs, works)."""
    check_num_entities(num_entities)
    book = NameBook(random.Random(seed))
    counts = entity_counts(num_entities)
    countries = _make_countries(book, counts["country"])
    cities = _make_cities(book, counts["city"], countries)
    people = _make_people(book, counts["person"], cities)
    orgs = _make_orgs(book, counts["org"], people, cities)
    for person in people:  # employers exist only once the organisations do
        person.facts["employer"] = book.rng.choice(orgs).entity_id
    works = _make_works(book, counts["work"], people, orgs)
    return {entity.entity_id: entity for entity in countries + cities + people + orgs + works}

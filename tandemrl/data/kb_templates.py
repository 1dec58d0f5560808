"""Natural-language templates of the knowledge base: passages, question frames, bridges, gold queries.

Invariant: every passage template of a fact kind contains `{value}` verbatim (the answer as written in
the corpus), and no filler sentence states a fact, so a fact is written in exactly one passage.
Questions are built from a frame of the asked fact kind around a noun phrase: the entity's name for a
single-hop question, or a bridge phrase ("the founder of X") for a two-hop one.
"""

from __future__ import annotations

# kind-specific wording for creative works: (verb, participle, role, issued, publisher role)
WORK_WORDS = {
    "novel": ("write", "written", "author", "published", "publisher"),
    "poetry collection": ("write", "written", "poet", "published", "publisher"),
    "play": ("write", "written", "playwright", "first staged", "producer"),
    "film": ("direct", "directed", "director", "released", "studio"),
    "album": ("record", "recorded", "artist", "released", "label"),
    "opera": ("compose", "composed", "composer", "premiered", "producer"),
}

PASSAGES = {
    "born_in": [
        "{name} was born in {value}. {filler}",
        "{filler} {name} was born and raised in the city of {value}.",
        "{value} is the birthplace of {name}. {filler}",
        "Born in {value}, {name} spent {possessive} early years there. {filler}",
    ],
    "birth_year": [
        "{name} was born in the year {value}. {filler}",
        "{filler} {name} (born {value}) is mentioned in several local histories.",
        "The records give {value} as the year of birth of {name}. {filler}",
    ],
    "occupation": [
        "{name} is {article} {value} by occupation. {filler}",
        "{filler} {name} worked for most of {possessive} life as {article} {value}, an occupation "
        "learned young.",
        "By occupation, {name} is {article} {value}. {filler}",
    ],
    "employer": [
        "{name} works for {value}, {possessive} employer for many years. {filler}",
        "{filler} {name} joined {value} and has stayed with that employer since.",
        "{name} is employed by {value}. {filler}",
    ],
    "country": [
        "{name} is a city in {value_long}. {filler}",
        "{filler} The city of {name} lies in the country of {value}.",
        "{name} is located in the country of {value}. {filler}",
    ],
    "founded_year": [
        "{name} was founded in {value}. {filler}",
        "{filler} The founding of {name} dates to {value}.",
        "{name} has existed since {value}, the year it was founded. {filler}",
    ],
    "capital": [
        "The capital of {name} is {value}. {filler}",
        "{filler} {value} serves as the capital city of {name}.",
        "{name} is governed from its capital, {value}. {filler}",
    ],
    "founded_by": [
        "{name} was founded by {value}. {filler}",
        "{filler} {value} is the founder of {name}.",
        "{name} was established by {value}, who set it up with a small staff. {filler}",
    ],
    "led_by": [
        "{name} is led by its chief executive, {value}. {filler}",
        "{filler} {value} serves as the chief executive of {name}.",
        "The chief executive and head of {name} is {value}. {filler}",
    ],
    "headquarters": [
        "{name} is headquartered in {value}. {filler}",
        "{filler} The headquarters of {name} are in the city of {value}.",
        "{name} has its headquarters and main offices in {value}. {filler}",
    ],
    "org_founded_year": [
        "{name} was founded in {value}. {filler}",
        "{filler} {name} was established in the year {value}.",
        "Since its founding in {value}, {name} has grown steadily. {filler}",
    ],
    "industry": [
        "{name} is a company in the {value} industry. {filler}",
        "{filler} {name} does business in the {value} industry.",
        "The industry of {name} is {value}, its main line of business. {filler}",
    ],
    "creator": [
        "{name} is {article_kind} {kind} {made} by {value}. {filler}",
        "{filler} {value} {made_past} the {kind} {name}.",
        "The {kind} {name} is the work of its {role}, {value}. {filler}",
    ],
    "year": [
        "{name} is {article_kind} {kind} {issued} in {value}. {filler}",
        "{filler} The {kind} {name} was {issued} in {value}.",
        "{name} was {issued} in the year {value}. {filler}",
    ],
    "publisher": [
        "{name} is {article_kind} {kind} whose {pub_role} is {value}. {filler}",
        "{filler} The {kind} {name} was brought out by {value}, its {pub_role}.",
        "{value} acted as {pub_role} for the {kind} {name}. {filler}",
    ],
    "genre": [
        "{name} is {article_genre} {value} {kind}. {filler}",
        "{filler} Critics classify the {kind} {name} as {value}.",
        "The genre of {name} is {value}. {filler}",
    ],
}

FILLERS = {
    "person": [
        "{Pronoun} is remembered for a quiet and careful manner.",
        "Little is recorded about {possessive} childhood.",
        "{Pronoun} kept extensive diaries that survive in private hands.",
        "Friends described {object} as patient and curious.",
        "{Pronoun} travelled widely as a young adult.",
    ],
    "city": [
        "The town is known for its narrow streets and old market.",
        "Its harbour and river trade shaped the local economy.",
        "The city holds a well-attended spring festival.",
        "Several old bridges cross the river there.",
    ],
    "country": [
        "The country is known for its mountain passes.",
        "Its parliament meets twice a year.",
        "The country has a long coastline and many islands.",
    ],
    "org": [
        "The organisation employs a few hundred people.",
        "It publishes an annual report on its activities.",
        "Its logo shows a stylised bird.",
        "The organisation is known for its apprenticeship programme.",
    ],
    "work": [
        "It received mixed reviews at first.",
        "A restored edition appeared decades later.",
        "The work has been translated into several languages.",
        "Its opening is often quoted.",
    ],
}

# question frames per fact kind; {np} is the entity's name or a bridge phrase
FRAMES = {
    "born_in": ["In which city was {np} born?", "Where was {np} born?", "What is the birthplace of {np}?"],
    "birth_year": ["In what year was {np} born?", "When was {np} born?", "What is the birth year of {np}?"],
    "occupation": [
        "What is the occupation of {np}?",
        "What does {np} do for a living?",
        "What was the profession of {np}?",
    ],
    "employer": ["Which organisation employs {np}?", "Who is the employer of {np}?", "Where does {np} work?"],
    "country": [
        "In which country is {np}?",
        "Which country is {np} located in?",
        "{np} is in which country?",
    ],
    "founded_year": ["In what year was {np} founded?", "When was {np} founded?"],
    "capital": ["What is the capital of {np}?", "Which city is the capital of {np}?"],
    "founded_by": ["Who founded {np}?", "Who is the founder of {np}?", "{np} was founded by whom?"],
    "led_by": ["Who is the chief executive of {np}?", "Who leads {np}?", "Who heads {np}?"],
    "headquarters": [
        "Where is {np} headquartered?",
        "In which city is {np} based?",
        "In which city are the headquarters of {np}?",
    ],
    "org_founded_year": ["In what year was {np} founded?", "When was {np} established?"],
    "industry": ["In which industry does {np} operate?", "What industry is {np} in?"],
    "creator": ["Who {verb_past} {np}?", "Who is the {role} of {np}?", "{np} was {made} by whom?"],
    "year": ["In what year was {np} {issued}?", "When was {np} {issued}?"],
    "publisher": ["Which organisation was the {pub_role} of {np}?", "Who was the {pub_role} of {np}?"],
    "genre": ["What is the genre of {np}?", "What genre does {np} belong to?"],
}

# bridge noun phrases: the entity reached through a fact, described from the question's entity
BRIDGES = {
    "born_in": ["the birthplace of {name}", "the city where {name} was born"],
    "employer": ["the employer of {name}", "the organisation that employs {name}"],
    "country": ["the country where {name} is located"],
    "capital": ["the capital of {name}"],
    "founded_by": ["the founder of {name}", "the person who founded {name}"],
    "led_by": ["the chief executive of {name}", "the head of {name}"],
    "headquarters": ["the city where {name} is headquartered", "the home city of {name}"],
    "creator": ["the {role} of {name}", "the person who {verb_past} {name}"],
    "publisher": ["the {pub_role} of {name}", "the organisation that brought out {name}"],
}

# gold search queries: the entity's name and the asked attribute
QUERIES = {
    "born_in": "{name} birthplace",
    "birth_year": "{name} birth year",
    "occupation": "{name} occupation",
    "employer": "{name} employer",
    "country": "{name} country",
    "founded_year": "{name} founded year",
    "capital": "{name} capital",
    "founded_by": "{name} founder",
    "led_by": "{name} chief executive",
    "headquarters": "{name} headquarters",
    "org_founded_year": "{name} year founded",
    "industry": "{name} industry",
    "creator": "{name} {role}",
    "year": "{name} year {issued}",
    "publisher": "{name} {pub_role}",
    "genre": "{name} genre",
}

# what a demo's <think> says it needs, per fact kind
NEEDS = {
    "born_in": "where {name} was born",
    "birth_year": "the year {name} was born",
    "occupation": "the occupation of {name}",
    "employer": "who employs {name}",
    "country": "which country {name} is in",
    "founded_year": "when {name} was founded",
    "capital": "the capital of {name}",
    "founded_by": "who founded {name}",
    "led_by": "who leads {name}",
    "headquarters": "where {name} is headquartered",
    "org_founded_year": "when {name} was founded",
    "industry": "the industry of {name}",
    "creator": "the {role} of {name}",
    "year": "when {name} was {issued}",
    "publisher": "the {pub_role} of {name}",
    "genre": "the genre of {name}",
}

# what a demo's <think> states once the fact is found
FOUND = {
    "born_in": "{name} was born in {value}.",
    "birth_year": "{name} was born in {value}.",
    "occupation": "{name} is {article} {value}.",
    "employer": "{name} works for {value}.",
    "country": "{name} is in {value}.",
    "founded_year": "{name} was founded in {value}.",
    "capital": "The capital of {name} is {value}.",
    "founded_by": "{name} was founded by {value}.",
    "led_by": "{name} is led by {value}.",
    "headquarters": "{name} is headquartered in {value}.",
    "org_founded_year": "{name} was founded in {value}.",
    "industry": "{name} is in the {value} industry.",
    "creator": "{name} was {made} by {value}.",
    "year": "{name} was {issued} in {value}.",
    "publisher": "The {pub_role} of {name} is {value}.",
    "genre": "{name} is {article_genre} {value} {kind}.",
}


def article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def fact_key(kind: str, relation: str) -> str:
    """Template key of a fact: organisations' founding year reads differently from a city's."""
    return "org_founded_year" if (kind, relation) == ("org", "founded_year") else relation


def wording(entity_detail: dict[str, str]) -> dict[str, str]:
    """Placeholders that depend on the entity itself: pronouns, the work kind's verbs."""
    pronoun = entity_detail.get("pronoun", "it")
    words = {
        "pronoun": pronoun,
        "Pronoun": pronoun.capitalize(),
        "possessive": {"he": "his", "she": "her"}.get(pronoun, "its"),
        "object": {"he": "him", "she": "her"}.get(pronoun, "it"),
    }
    kind = entity_detail.get("work_kind")
    if kind:
        verb, made, role, issued, pub_role = WORK_WORDS[kind]
        verb_past = {"write": "wrote"}.get(verb, made)
        words.update(
            kind=kind,
            verb=verb,
            made=made,
            made_past=verb_past,
            verb_past=verb_past,
            role=role,
            issued=issued,
            pub_role=pub_role,
            article_kind=article(kind),
        )
    return words

"""Word lists of the fictional world: syllables for names, and the vocabularies of facts and titles.

Invariant: these are ordered lists (the generator draws from them with a seeded `random.Random`), so
reordering or editing one changes every generated knowledge base — bump `kb.KB_VERSION` when you do.
Lists are written as "|"-separated strings to stay compact; an empty item is a deliberate "no coda".
"""

from __future__ import annotations


def _words(text: str) -> list[str]:
    return [word.strip() for word in text.split("|")]


ONSETS = _words("b|br|c|d|dr|f|g|gr|h|k|kr|l|m|n|p|r|s|st|t|th|v|w|z|sh|ch|y|tr|fl")
VOWELS = _words("a|e|i|o|u|a|e|o|ae|ei|ou")
INNER_CODAS = _words("||||n|r|l|s")
CODAS = _words("||n|r|l|s|th|nd|rk|m|x|v|sk|lt")
CITY_SUFFIXES = _words("holm|ford|wick|mere|dale|grad|haven|port|stad|bury|ton|vik")
CITY_PREFIXES = _words("Port|New|Old|Upper|Lower|Saint|East|West|North|South")
COUNTRY_SUFFIXES = _words("ia|ar|land|istan|onia|ovia|ece|uria")
COUNTRY_FORMS = _words("Republic|Kingdom|Federation|Commonwealth|Principality|Union")
ORG_SUFFIXES = _words(
    "Group|Holdings|Works|Company|Collective|Partners|Labs|Foundry|Institute|Guild|Trust|Consortium|"
    "Press|Studios|Society|Ventures"
)
ORG_WORDS = _words(
    "Amber|Beacon|Cobalt|Crescent|Driftwood|Ember|Falcon|Granite|Harbor|Ironleaf|Juniper|Kestrel|"
    "Lantern|Meridian|Northwind|Obsidian|Pinecrest|Quill|Riverstone|Saffron|Tidewater|Umber|Vantage|"
    "Willow|Yarrow|Zephyr|Copperline|Silverbirch|Thornfield|Bluegate|Redmoor|Greyhollow|Starling"
)
INDUSTRIES = _words(
    "shipbuilding|textiles|publishing|glassmaking|brewing|software|mining|insurance|railways|"
    "pharmaceuticals|aviation|banking|furniture|ceramics|telecommunications|agriculture|clockmaking|"
    "robotics|cartography|perfumery"
)
OCCUPATIONS = _words(
    "painter|architect|cartographer|novelist|chemist|sculptor|astronomer|composer|botanist|engineer|"
    "historian|photographer|mathematician|poet|economist|physician|journalist|linguist|geologist|"
    "violinist|diplomat|playwright|zoologist|philosopher|clockmaker|shipwright|glassblower|lawyer"
)
WORK_KINDS = _words("novel|play|film|album|poetry collection|opera")
GENRES = {
    "novel": _words("mystery|romance|satire|fantasy|thriller|adventure"),
    "play": _words("tragedy|comedy|farce|melodrama"),
    "film": _words("western|documentary|thriller|musical|comedy|fantasy"),
    "album": _words("jazz|folk|blues|reggae|baroque pop|ambient"),
    "poetry collection": _words("elegy|pastoral|sonnet cycle|ballad"),
    "opera": _words("tragedy|comedy|operetta|farce"),
}
TITLE_ADJS = _words(
    "Silent|Glass|Crimson|Hollow|Distant|Burning|Frozen|Golden|Broken|Wandering|Hidden|Velvet|Iron|"
    "Paper|Salt|Quiet|Painted|Last|Bitter|Sleeping|Copper|Northern|Weeping|Crooked|Pale|Restless|"
    "Sunken|Lonely"
)
TITLE_NOUNS = _words(
    "Harbor|Orchard|Lantern|Garden|Tide|Mirror|Compass|Meadow|Tower|River|Clockmaker|Winter|Island|"
    "Letter|Bridge|Cathedral|Crown|Forest|Map|Violin|Archive|Lighthouse|Shore|Season|Cartographer|"
    "Voyage|Feather|Kingdom|Chorus|Stranger|Ferry|Quarry|Observatory|Vineyard"
)

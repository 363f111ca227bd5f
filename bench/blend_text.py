"""More text for bench/blend.py: four fictional reference documents, generated from a fixed seed, with questions.

Each document is a short introduction and eight entries (a town, a ship, a garden, a bridge), each entry a
paragraph of plain prose built from sentence templates and drawn facts (years, numbers, names). Every fact
a question asks about appears once, verbatim, in its entry, and values do not repeat within a document, so
the passage holding an answer is unambiguous. Nothing is downloaded; the same seed gives the same text.
"""

from __future__ import annotations

import random

SYLLABLES = ["al", "bar", "cen", "dor", "el", "fen", "gar", "hol", "is", "kel", "lor", "mar", "nor", "or",
             "pel", "quin", "ros", "sel", "tor", "ul", "ven", "wick", "yar", "zan", "ash", "brid", "cal", "dun"]
SURNAMES = ["Abernethy", "Blackwood", "Carrow", "Dunmore", "Ellery", "Fairbairn", "Garside", "Hollis",
            "Ingram", "Jessop", "Kettering", "Lowther", "Marchbank", "Nettleton", "Oakes", "Pennock",
            "Quarrie", "Rudd", "Stainton", "Tullis", "Upshaw", "Varley", "Whitlock", "Yeadon"]
GIVEN = ["Agnes", "Bertram", "Clara", "Duncan", "Edith", "Frederick", "Greta", "Howard", "Isla", "Jonas",
         "Katrin", "Leopold", "Maud", "Nils", "Olive", "Percival", "Rosa", "Silas", "Thea", "Walter"]
GOODS = ["wool", "slate", "barley", "salted herring", "copper wire", "glassware", "oak timber", "paper",
         "linen", "cider", "clay pipes", "rope", "leather", "tin plate", "oats", "cheese"]
COLOURS = ["blue", "ochre", "green", "crimson", "grey", "white", "black", "yellow", "violet", "amber"]
PLANTS = ["winter jasmine", "sea kale", "bog myrtle", "red campion", "sweet cicely", "marsh marigold",
          "wild thyme", "hart's tongue fern", "lady's mantle", "yellow flag iris", "saxifrage", "rosebay",
          "meadowsweet", "wood sorrel", "sea holly", "monkshood"]


def _name(rng: random.Random, used: set[str], n: int = 2) -> str:
    while True:
        s = "".join(rng.choice(SYLLABLES) for _ in range(n)).capitalize()
        if s not in used:
            used.add(s)
            return s


def _unique(rng: random.Random, used: set, draw) -> object:
    while True:
        v = draw()
        if v not in used:
            used.add(v)
            return v


def _person(rng: random.Random, used: set[str]) -> str:
    return str(_unique(rng, used, lambda: f"{rng.choice(GIVEN)} {rng.choice(SURNAMES)}"))


def towns(rng: random.Random):
    used: set = set()
    years: set = set()
    pops: set = set()
    people: set = set()
    goods: set = set()
    intro = ("# A Gazetteer of the Vellan River Towns\n\n"
             "The Vellan rises in the moorland above the old mining country and runs for about two hundred "
             "kilometers to the sea. The towns along its banks grew up around fords, mills and wharves, and "
             "each keeps its own records of founding, trade and local custom. The entries below summarise those "
             "records for the general reader; figures are taken from the most recent parish returns.")
    paras, facts = [], []
    for _ in range(8):
        town = _name(rng, used) + rng.choice(["ford", "bridge", "wick", "mouth", "stow", "ham"])
        year = _unique(rng, years, lambda: rng.randint(1150, 1890))
        pop = _unique(rng, pops, lambda: rng.randint(12, 480) * 100)
        mayor = _person(rng, people)
        good = _unique(rng, goods, lambda: rng.choice(GOODS))
        fair = rng.choice(["March", "April", "May", "June", "September", "October"])
        mills = rng.randint(2, 9)
        paras.append(
            f"## {town}\n\n{town} received its market charter in {year}, when the river crossing there was "
            f"still a ford of loose gravel. The town grew on the trade in {good}, which left its wharves by "
            f"barge until the railway came. At the last count it had {pop:,} residents, and the present mayor is "
            f"{mayor}. Visitors remark on the {rng.choice(COLOURS)} stone of the older houses and on the "
            f"{mills} water mills that still stand along the lower bank, though only one of them grinds grain today. "
            f"The town fair is held every {fair}, and in wet years the meadows below the church flood as far "
            f"as the bridge.")
        facts += [(f"In what year did {town} receive its market charter?", str(year)),
                  (f"What trade did the town of {town} grow on?", str(good)),
                  (f"Who is the present mayor of {town}?", mayor)]
    return "river-towns", intro, paras, facts


def ships(rng: random.Random):
    used: set = set()
    years: set = set()
    tons: set = set()
    people: set = set()
    intro = ("# The Register of the Northern Coasting Fleet\n\n"
             "Before the motor lorry, most heavy goods on the northern coast moved by small sailing and steam "
             "vessels that called at every harbour with a quay. This register lists some of the better known "
             "ships of the coasting fleet, with their builders, masters and fates, as recorded by the harbour "
             "boards and the families who sailed in them.")
    paras, facts = [], []
    for _ in range(8):
        ship = f"{rng.choice(['Lady', 'Star of', 'Maid of', 'Spirit of', 'Pride of'])} {_name(rng, used)}"
        year = _unique(rng, years, lambda: rng.randint(1840, 1925))
        ton = _unique(rng, tons, lambda: rng.randint(40, 900))
        master = _person(rng, people)
        yard = _name(rng, used) + " Yard"
        cargo = rng.choice(GOODS)
        fate = rng.choice(["was broken up for scrap", "was lost with all hands in a winter gale",
                           "ended her days as a hulk in the estuary", "was sold to owners in the south"])
        paras.append(
            f"## {ship}\n\nThe {ship} was launched at {yard} in {year} and registered at {ton} tons. "
            f"She carried mostly {cargo} between the smaller harbours, and for eleven seasons her master was "
            f"{master}, who was known along the coast for sailing in weather that kept other crews ashore. "
            f"Her hull was painted {rng.choice(COLOURS)} with a white band, which made her easy to pick out "
            f"from the harbour wall. After many years of service she {fate}; a model of her hangs in the "
            f"reading room of the seamen's institute.")
        facts += [(f"At which yard was the {ship} launched?", yard),
                  (f"What was the registered tonnage of the {ship}?", f"{ton} tons"),
                  (f"Who was the master of the {ship} for eleven seasons?", master)]
    return "coasting-fleet", intro, paras, facts


def gardens(rng: random.Random):
    used: set = set()
    areas: set = set()
    years: set = set()
    people: set = set()
    plants: set = set()
    intro = ("# Walled Gardens of the Western Estates\n\n"
             "Many country houses of the western estates kept a walled kitchen garden, sheltered from the wind "
             "and warmed by brick that held the heat of the day. Some have been restored by volunteers and are "
             "open to visitors in the summer months. The notes below describe each garden, its size, the "
             "people who made it and the plants it is known for.")
    paras, facts = [], []
    for _ in range(8):
        garden = f"{_name(rng, used)} House"
        area = _unique(rng, areas, lambda: round(rng.uniform(0.4, 6.0), 1))
        year = _unique(rng, years, lambda: rng.randint(1690, 1910))
        gardener = _person(rng, people)
        plant = _unique(rng, plants, lambda: rng.choice(PLANTS))
        paras.append(
            f"## {garden}\n\nThe walled garden at {garden} covers {area} hectares and was laid out in {year} "
            f"by the head gardener {gardener}, whose planting notebooks survive in the county archive. "
            f"The south-facing wall still carries the iron hooks that once held espaliered pears, and the "
            f"glasshouses along the north wall were rebuilt after a storm broke most of their panes. Today the "
            f"garden is best known for its {plant}, which flowers in a long border beside the old dipping pond. "
            f"The gate is painted {rng.choice(COLOURS)}, and volunteers work there on "
            f"{rng.choice(['Tuesdays', 'Wednesdays', 'Thursdays', 'Saturdays'])}.")
        facts += [(f"How large is the walled garden at {garden}?", f"{area} hectares"),
                  (f"Which head gardener laid out the garden at {garden}?", gardener),
                  (f"What plant is the garden at {garden} best known for?", str(plant))]
    return "walled-gardens", intro, paras, facts


def bridges(rng: random.Random):
    used: set = set()
    spans: set = set()
    costs: set = set()
    people: set = set()
    intro = ("# Bridges of the Carrow Valley\n\n"
             "The Carrow valley is crossed by bridges of almost every kind built in the last three centuries: "
             "packhorse bridges of rubble stone, masonry arches, cast iron, wrought iron lattice and reinforced "
             "concrete. Each entry gives the bridge's engineer, its main span and what it cost to build, from "
             "the accounts of the turnpike trusts and the county surveyor.")
    paras, facts = [], []
    for _ in range(8):
        bridge = f"{_name(rng, used)} Bridge"
        span = _unique(rng, spans, lambda: rng.randint(9, 140))
        cost = _unique(rng, costs, lambda: rng.randint(3, 95) * 100)
        engineer = _person(rng, people)
        kind = rng.choice(["a single masonry arch", "three cast iron ribs", "a wrought iron lattice girder",
                           "a reinforced concrete bow", "five rubble stone arches"])
        year = rng.randint(1720, 1935)
        paras.append(
            f"## {bridge}\n\n{bridge} was designed by {engineer} and opened in {year}. It crosses the river "
            f"with {kind} and a main span of {span} meters, long enough that the trust's first surveyor doubted "
            f"it would stand. The works cost {cost:,} pounds, paid for by tolls that were not lifted until the "
            f"county took the road over. The parapets were rebuilt after a flood carried away the upstream side, "
            f"and the toll house at the eastern end is now a private cottage painted {rng.choice(COLOURS)}.")
        facts += [(f"Who designed {bridge}?", engineer),
                  (f"What is the main span of {bridge}?", f"{span} meters"),
                  (f"How much did the works on {bridge} cost?", f"{cost:,} pounds")]
    return "carrow-bridges", intro, paras, facts


def generate(seed: int = 7, per_doc: int = 4) -> tuple[dict[str, str], list[dict[str, str]]]:
    """(documents by name, questions ``{"doc", "question", "answer"}``): ``per_doc`` questions per document."""
    docs: dict[str, str] = {}
    questions: list[dict[str, str]] = []
    for k, make in enumerate((towns, ships, gardens, bridges)):
        rng = random.Random(seed * 100 + k)
        name, intro, paras, facts = make(rng)
        docs[name] = intro + "\n\n" + "\n\n".join(paras) + "\n"
        # Questions about different entries, spread over the document (each entry has 3 facts).
        picks = rng.sample(range(len(paras)), per_doc)
        for i in picks:
            q, a = facts[3 * i + rng.randrange(3)]
            assert docs[name].count(a) == 1, (name, a)
            questions.append({"doc": name, "question": q, "answer": a})
    return docs, questions


if __name__ == "__main__":
    d, qs = generate()
    for name, text in d.items():
        print(f"{name}: {len(text.split())} words")
    for q in qs:
        print(q)

"""The needle-in-the-middle set of ``bench/steer.py``: ordinary prose documents, one synthetic fact, one question.

Documents are built procedurally from topic sentence banks written for this bench (not the shipped sample
documents): each topic has a pool of plain, fact-free sentences with slot fillers, shuffled into paragraphs.
A case is 3-5 such documents (different topics), 1-2k tokens in all; a short synthetic fact -- a code, a
time or a name -- is placed inside a middle document (never the first or the last), and the question asks
for it. Everything is drawn from ``random.Random(seed)``: the same seed gives the same cases, and disjoint
seeds give disjoint tuning and test splits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PLACES = ["Aldermoor", "Brackwater", "Cindervale", "Dunmere", "Eastholm", "Fernby", "Galloway Cross", "Harrowgate",
          "Ivybridge", "Juniper Falls", "Kestrel Bay", "Larkspur", "Millbrook", "Northwick", "Oakhurst", "Pinecliff",
          "Queensford", "Redfield", "Stonehaven", "Thistledown", "Upton Vale", "Westmarch", "Yarrow Point"]
PEOPLE = ["the farmers", "the old residents", "local teachers", "the town council", "visiting students",
          "the shopkeepers", "most families", "the fishermen", "young apprentices", "the volunteers"]
SEASONS = ["spring", "summer", "autumn", "winter"]

TOPICS: dict[str, list[str]] = {
    "gardening": [
        "A good garden begins with soil that drains well but still holds some moisture after rain.",
        "In {place}, {people} usually turn the beds over in early {season} and mix in compost from the year before.",
        "Tomatoes want a sunny spot, regular watering and a stake to lean on once the fruit grows heavy.",
        "Many gardeners keep a small notebook of what they planted where, so that crops can rotate from year to year.",
        "Slugs are the quiet enemy of lettuce, and a ring of crushed shells around each plant slows them down.",
        "Herbs such as thyme and rosemary prefer poor, dry soil and often do better when they are left alone.",
        "Watering in the early morning lets the leaves dry before the heat of the day and keeps mildew away.",
        "A compost heap needs a balance of green clippings and brown material like dry leaves or shredded paper.",
        "Beans fix nitrogen in the soil, which is why they are often planted before hungrier crops.",
        "Mulch keeps the ground cool, holds in water and smothers the weeds that would otherwise crowd the rows.",
        "Fruit trees are pruned in late winter, when the branches are bare and the shape of the tree is easy to see.",
        "Bees visit the flowering borders all {season}, and the vegetable beds are better for their company.",
        "Seedlings raised indoors should spend a week outside in the daytime before they are planted out.",
        "A simple wooden frame covered with old windows makes a cold frame that extends the season by weeks.",
        "Some of {people} in {place} still save their own seeds, drying them on paper by the kitchen window.",
    ],
    "baking": [
        "Bread needs only flour, water, salt and yeast, yet the results vary endlessly with time and temperature.",
        "A slow rise in a cool kitchen gives the dough more flavour than a quick rise in a warm one.",
        "In {place}, the bakery on the square has opened before dawn for as long as {people} can remember.",
        "Kneading develops the gluten, and the dough is ready when it stretches thin without tearing.",
        "A hot oven and a tray of water on the lowest shelf give the loaf a crisp, shining crust.",
        "Pastry should be handled as little as possible and kept cold, or the butter melts and the layers vanish.",
        "Many bakers weigh their ingredients instead of measuring cups, because flour packs differently each time.",
        "A loaf is done when it sounds hollow as you tap the bottom of it with a knuckle.",
        "Rye flour makes a dense, dark bread that keeps for a week and tastes better on the second day.",
        "In {season}, the shops sell spiced buns, fruit cakes and the small honey biscuits children like.",
        "Letting bread cool on a rack keeps the bottom from turning soft with trapped steam.",
        "Sourdough starters are fed with flour and water every day and can live for many years.",
        "Too much flour on the bench makes the dough dry, so experienced bakers use only a light dusting.",
        "A cake rises evenly when the batter is poured into a tin that has been greased and lined.",
        "Old recipes from {place} often call for lard, which gives a short, crumbly texture to pies.",
    ],
    "hiking": [
        "A day in the hills starts with a look at the weather and a map folded to the right section.",
        "The trail above {place} climbs gently through pine woods before it opens onto the ridge.",
        "Good boots matter more than anything else, and they should be worn in before any long walk.",
        "Walkers carry water, a warm layer and something to eat, even on a clear {season} morning.",
        "Cairns mark the route where the path crosses bare rock and the way is hard to follow.",
        "{people} say the view from the summit reaches the sea on a day without haze.",
        "Streams can rise quickly after rain, so a crossing that is easy in the morning may be dangerous by evening.",
        "It is wise to tell someone the planned route and the time you expect to be back.",
        "Descending is harder on the knees than climbing, and walking poles take some of the strain.",
        "In mist, a compass bearing is more reliable than following what looks like a path.",
        "Sheep tracks often wander off toward grazing and lead walkers away from the real trail.",
        "The hut below the pass offers shelter, a stove and a logbook where visitors write their names.",
        "Late in {season} the days are short, and a headlamp belongs in every pack.",
        "Blisters are easier to prevent than to treat, so walkers stop to fix a rubbing sock at once.",
        "The circular route from {place} takes most people about five hours at an easy pace.",
    ],
    "rivers": [
        "The river that runs through {place} was once the main road for timber and grain.",
        "Barges were pulled upstream by horses walking along the towpath on the northern bank.",
        "In {season} the water runs high and brown with melted snow from the hills.",
        "Herons stand motionless in the shallows, waiting for small fish to come within reach.",
        "An old stone bridge with five arches still carries the road across the widest part of the valley.",
        "{people} remember the great flood, when the water reached the steps of the church.",
        "Mills were built wherever the current was strong enough to turn a wheel through the year.",
        "The riverbank is lined with willows, whose roots hold the soil together when the water rises.",
        "Fishing is allowed from the meadows below the weir, though only with a permit from the town.",
        "Otters had vanished from the river for decades, but they have returned in recent years.",
        "A ferry once crossed where the bridge now stands, and the ferryman's cottage is a small museum.",
        "The water is clearer than it was, thanks to new rules on what factories may release.",
        "Children float paper boats from the bridge and race to see which one reaches the bend first.",
        "Canoeists launch from the slipway near the boathouse and paddle down to the next village.",
        "Maps from two hundred years ago show the river in a different bed, farther to the east.",
    ],
    "markets": [
        "Every Saturday the square in {place} fills with stalls selling vegetables, cheese and bread.",
        "Traders arrive before sunrise to set up their tables and unload their vans.",
        "{people} know which stall has the best apples and which one gives a fair weight.",
        "In {season}, there are baskets of berries, bunches of flowers and jars of honey.",
        "Haggling is part of the fun, although most prices are written on small chalk boards.",
        "A man with an accordion plays near the fountain and collects coins in his hat.",
        "The fish stall keeps its catch on ice and sells out before the church bells ring noon.",
        "Some families have held the same pitch in the market for three generations.",
        "Leftover produce is given to the food bank when the market closes in the afternoon.",
        "The market hall was rebuilt after a fire, with iron columns and a glass roof.",
        "Cheese makers from the valley bring wheels that have aged for months in cool cellars.",
        "Visitors often stop for a cup of tea at the small cafe on the corner of the square.",
        "Rules set by the town decide where each trader may stand and how long they may stay.",
        "On rainy days the stalls huddle under awnings and the crowds are thinner.",
        "A handwritten sign at the entrance reminds shoppers to bring their own bags.",
    ],
    "weather": [
        "The weather in {place} changes quickly, and locals rarely trust a sunny morning.",
        "Westerly winds bring rain from the sea, while easterly winds bring cold, dry air.",
        "In {season}, fog settles in the valley and lifts only in the late morning.",
        "{people} watch the clouds over the hills to judge whether a storm is coming.",
        "Thunderstorms are most common in the late afternoon after a hot and humid day.",
        "A ring around the moon is said to mean rain within a day or two.",
        "Frost can come as late as the first weeks of spring, which worries fruit growers.",
        "The weather station on the hill has kept daily records for more than a century.",
        "Snow rarely lies for long near the coast, but the high farms can be cut off for days.",
        "A dry summer lowers the reservoirs and brings limits on watering gardens.",
        "Sea breezes keep the coast cooler than inland towns on a hot afternoon.",
        "Old sayings about the weather are often wrong, but a few hold a grain of truth.",
        "The longest dry spell on record lasted almost two months and dried up several wells.",
        "Strong gales in winter bring down trees and close the coast road for a few hours.",
        "Rainbows are frequent in showery weather when the sun comes out between the clouds.",
    ],
    "libraries": [
        "The library in {place} occupies a brick building that was once the corn exchange.",
        "Its reading room has tall windows, long oak tables and green lamps on every desk.",
        "{people} come in the afternoons to read newspapers and borrow novels.",
        "Children's story time is held every week and is popular with parents of small children.",
        "The local history section keeps old photographs, maps and parish records.",
        "Books are returned through a slot in the door when the library is closed.",
        "Volunteers help older visitors learn to use the computers near the entrance.",
        "In {season}, the library runs a reading challenge with small prizes for young readers.",
        "A quiet room upstairs is set aside for students preparing for examinations.",
        "Damaged books are repaired by hand in a small workshop behind the counter.",
        "The catalogue was moved from index cards to a computer system many years ago.",
        "Reading groups meet in the evening to discuss a chosen book over tea.",
        "Donations from residents have added hundreds of books to the shelves.",
        "The librarians can order almost any book from other libraries in the region.",
        "A small exhibition near the stairs changes every month and shows local art.",
    ],
    "railways": [
        "The railway reached {place} in the age of steam and changed the town within a decade.",
        "Trains carried coal, milk and passengers along the single track through the valley.",
        "{people} still call the old goods yard by its original name, though it is now a car park.",
        "The station has a wooden canopy, a ticket office and a waiting room with a fireplace.",
        "In {season}, a heritage steam engine runs on the restored section of the line.",
        "Signal boxes once stood at every junction, each staffed by a signalman day and night.",
        "The viaduct over the gorge is the tallest structure for many miles around.",
        "Railway cottages line the road near the station, built for workers and their families.",
        "The branch line was closed to passengers long ago, but freight trains still use it.",
        "Timetables from the early days show trains running more often than they do today.",
        "A model railway club meets in the old parcels office on weekday evenings.",
        "Snow ploughs were attached to engines in hard winters to keep the line open.",
        "Walkers now follow parts of the old trackbed, which makes a level and easy path.",
        "The station clock was made by a local firm and has kept good time for a century.",
        "Volunteers paint the benches and tend the flower boxes along the platform.",
    ],
}

# Sentences about any town, mixed into every document so that documents reach 300-600 tokens.
GENERAL = [
    "{place} grew up around a crossroads where two old trading routes met.",
    "Most of the houses in the centre are built of local stone and roofed with slate.",
    "{people} tend to know one another by name, and news travels quickly.",
    "The parish church has a square tower that can be seen from the surrounding fields.",
    "A bus runs to the nearest city twice a day, though many people still prefer to drive.",
    "In {season}, the town holds a fair with music, games and stalls along the main street.",
    "The primary school has fewer than a hundred pupils and a playground shaded by chestnut trees.",
    "Several shops on the high street have been run by the same families for decades.",
    "The town hall keeps a small archive of letters, deeds and photographs from the last two centuries.",
    "A footpath along the edge of the common leads to a viewpoint with a wooden bench.",
    "New houses have been built on the eastern side of {place}, and the population has slowly grown.",
    "The local newspaper comes out once a week and reports on council meetings and sports results.",
    "{people} often meet in the pub by the green, where the fire is lit on cold evenings.",
    "Tourists come mainly in {season}, when the hotels and guest houses fill up.",
    "The doctor's surgery, the post office and the pharmacy all stand within a few steps of the square.",
    "A community garden was started on a piece of waste ground behind the station.",
    "The war memorial lists the names of men from {place} and the villages around it.",
    "Broadband arrived late, and some of the outlying farms still have a slow connection.",
    "A choir rehearses in the church hall every Thursday and gives a concert at midwinter.",
    "The sports club has a cricket pitch, two tennis courts and a small pavilion.",
]

# (question, fact sentence, answer) templates; {x} is the drawn value.
CODES = [("What is the access code for the north storage room?",
          "The access code for the north storage room is {x}.", "code"),
         ("What is the reference number of the repair order?",
          "The repair order was filed under reference number {x}.", "code"),
         ("What is the combination of the boathouse lock?",
          "The boathouse lock opens with the combination {x}.", "code")]
TIMES = [("At what time does the ferry to {place} leave?",
          "The ferry to {place} leaves every day at {x}.", "time"),
         ("At what time does the committee meeting start?",
          "The committee meeting starts at {x} sharp.", "time"),
         ("At what time does the night train depart?",
          "The night train departs from platform two at {x}.", "time")]
NAMES = [("Who is the new head of the archive committee?",
          "The new head of the archive committee is {x}.", "name"),
         ("Who won the annual pumpkin contest?",
          "The annual pumpkin contest was won by {x}.", "name"),
         ("Who keeps the key to the bell tower?",
          "The key to the bell tower is kept by {x}.", "name")]
FIRST = ["Marta", "Ivo", "Selma", "Oskar", "Nadia", "Tobias", "Greta", "Emil", "Lena", "Anselm", "Petra", "Rafael"]
LAST = ["Quill", "Brennock", "Vasquez", "Holloway", "Tamsin", "Okafor", "Lindqvist", "Marchetti", "Dufresne",
        "Kowalczyk", "Ferreira", "Abernathy"]


@dataclass
class Case:
    documents: list[str]  # in context order
    needle_doc: int  # index of the document holding the fact (never first or last)
    fact: str  # the sentence inserted
    question: str
    answer: str  # counted correct when it appears in the generated text
    kind: str  # code / time / name


def _value(rng: random.Random, kind: str) -> tuple[str, str]:
    """(as written in the document, what counts as the answer)."""
    if kind == "code":
        x = str(rng.randint(1000, 9999)) + "-" + rng.choice("ABCDEFGHJKLMNPRSTUVWXYZ") + str(rng.randint(1, 9))
        return x, x
    if kind == "time":
        h, m = rng.randint(5, 22), rng.choice(range(5, 60, 5))
        x = f"{h}:{m:02d}"
        return x, x
    first, last = rng.choice(FIRST), rng.choice(LAST)
    return f"{first} {last}", last


def document(rng: random.Random, topic: str, n_sentences: int) -> list[str]:
    """Paragraphs of one topic's sentences, slots filled (a sentence is used at most once)."""
    place = rng.choice(PLACES)
    own = rng.sample(TOPICS[topic], min(n_sentences, len(TOPICS[topic])))
    general = rng.sample(GENERAL, max(0, n_sentences - len(own)))
    sents = own[:]
    for g in general:  # general sentences scattered among the topic's own
        sents.insert(rng.randint(1, len(sents)), g)
    out = [s.format(place=place, people=rng.choice(PEOPLE), season=rng.choice(SEASONS)) for s in sents]
    out = [s[0].upper() + s[1:] for s in out]
    paras, i = [], 0
    while i < len(out):
        k = rng.randint(3, 5)
        paras.append(" ".join(out[i:i + k]))
        i += k
    return paras


def make_case(rng: random.Random) -> Case:
    n_docs = rng.randint(3, 5)
    topics = rng.sample(sorted(TOPICS), n_docs)
    per_doc = {3: (18, 23), 4: (14, 17), 5: (11, 13)}[n_docs]
    docs = [document(rng, t, rng.randint(*per_doc)) for t in topics]
    needle_doc = rng.randint(1, n_docs - 2)
    q_tpl, f_tpl, kind = rng.choice(rng.choice([CODES, TIMES, NAMES]))
    place = rng.choice(PLACES)
    written, answer = _value(rng, kind)
    fact = f_tpl.format(x=written, place=place)
    question = q_tpl.format(place=place)
    paras = docs[needle_doc]
    p = rng.randint(1, max(1, len(paras) - 1)) if len(paras) > 1 else 0  # never the document's first paragraph
    sents = paras[p].split(". ")
    at = rng.randint(1, len(sents) - 1) if len(sents) > 1 else 1
    sents.insert(at, fact.rstrip("."))
    paras[p] = ". ".join(sents)
    if not paras[p].endswith("."):
        paras[p] += "."
    texts = [f"Document {i + 1}: {topics[i].capitalize()}\n\n" + "\n\n".join(d) for i, d in enumerate(docs)]
    return Case(documents=texts, needle_doc=needle_doc, fact=fact, question=question, answer=answer, kind=kind)


def make_cases(n: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    return [make_case(rng) for _ in range(n)]


def continuation(rng: random.Random, n_sentences: int = 8) -> str:
    """An unrelated paragraph of prose (a topic drawn at random) for the NLL check."""
    topic = rng.choice(sorted(TOPICS))
    return " ".join(document(rng, topic, n_sentences))

#!/usr/bin/env python3
"""Generate examples/train/train-00.jsonl: synthetic training prompts for
distilling draft models.

Prompts are built from hand-written templates and word lists below and are
deterministic for a fixed seed.  Any prompt that also appears verbatim in the
demo or held-out prompt files is skipped, so the three sets stay disjoint.

Usage:
    python examples/train/make_train.py                # writes train-00.jsonl next to this file
    python examples/train/make_train.py --n 400 --seed 3 --out /tmp/train.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent

KINDS = ["copy", "rewrite", "list", "arithmetic", "code", "question", "story"]

# ---------------------------------------------------------------- word lists
NAMES = ["Ada", "Bruno", "Chloe", "Dev", "Elena", "Farid", "Greta", "Hiro",
         "Iris", "Jonah", "Kemi", "Luis", "Mina", "Noor", "Oskar", "Priya",
         "Quinn", "Rosa", "Sami", "Tariq", "Uma", "Viktor", "Wren", "Yusuf"]
CITIES = ["Oslo", "Nairobi", "Lima", "Osaka", "Dublin", "Porto", "Montreal",
          "Hanoi", "Krakow", "Cairo", "Denver", "Perth", "Seville", "Tallinn"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "March", "May", "June", "August", "October", "November"]
PLACES = ["the harbor", "the old mill", "the school gym", "the night market",
          "the train station", "the hilltop garden", "the corner cafe",
          "the museum steps", "the village square", "the public pool"]
OBJECTS = ["a red bicycle", "three paper lanterns", "a jar of honey",
           "an old brass key", "a basket of plums", "a folded map",
           "a wooden chess set", "two loaves of bread", "a striped umbrella",
           "a box of colored chalk", "a broken radio", "a bag of seeds"]
PAST_ACTIONS = ["left", "found", "carried", "sold", "borrowed", "wrapped",
                "dropped", "hid", "forgot", "noticed"]
TIMES = ["before sunrise", "after the storm", "on a windy afternoon",
         "late at night", "during the festival", "just before lunch",
         "at the end of summer", "while everyone was asleep"]
NOTICES = [
    "the meeting moves to {place} on {day}.",
    "please wipe your shoes before entering {place}.",
    "the choir will rehearse at {place} every {day}.",
    "lost dog seen near {place} on {day} morning.",
    "free soup at {place} this {day} from noon.",
    "no bikes allowed inside {place}.",
]
MOTTOS = ["Slow and steady wins the race.", "Measure twice, cut once.",
          "Every day is a fresh start.", "Keep calm and carry on reading.",
          "Less noise, more music.", "Water the plants on Sunday.",
          "Leave the place cleaner than you found it."]
WORD_SETS = [
    ["maple", "birch", "cedar", "willow", "pine"],
    ["violin", "drum", "flute", "piano", "harp", "trumpet"],
    ["salt", "pepper", "cumin", "paprika", "basil"],
    ["north", "east", "south", "west"],
    ["alpha", "beta", "gamma", "delta", "epsilon"],
    ["hammer", "saw", "drill", "wrench", "pliers", "chisel"],
    ["Mercury", "Venus", "Earth", "Mars"],
    ["one", "two", "three", "five", "eight", "thirteen"],
]

CASUAL = [
    "Can't come tomorrow, got a doctor thing.",
    "The wifi is dead again, somebody please sort it out.",
    "Gonna be late, traffic is crazy.",
    "Thanks heaps for the cake, it was super tasty.",
    "We need the numbers by Friday or we're in trouble.",
    "That movie was kind of boring, to be honest.",
    "Just checking if you got my last message?",
    "The new guy is really good with spreadsheets.",
    "Sorry, my bad, I sent the wrong file.",
    "Let's grab a coffee and go over the plan.",
    "Yo, the fridge in the break room smells weird.",
    "I dunno if the bus runs on holidays.",
]
TECHNICAL = [
    "Condensation occurs when water vapor cools and changes back into liquid droplets.",
    "Friction is a force that opposes the relative motion of two surfaces in contact.",
    "Inflation refers to a sustained increase in the general price level of goods and services.",
    "Erosion is the gradual removal of soil and rock by wind, water, or ice.",
    "A vaccine trains the immune system to recognize a specific pathogen.",
    "Compound interest is interest calculated on both the principal and previously accumulated interest.",
    "Gravity is the attractive force that exists between any two objects with mass.",
    "Migration is the seasonal movement of animals from one region to another.",
    "An ecosystem consists of living organisms interacting with their physical environment.",
    "Digestion is the breakdown of food into smaller components the body can absorb.",
]
WORDY = [
    "In the event that you happen to have any questions at all, please do not hesitate to get in touch with us.",
    "It is absolutely essential and necessary that each and every participant arrives on time.",
    "The reason why the project was delayed is because of the fact that the materials arrived late.",
    "At the present moment in time, the store is closed for renovations that are currently ongoing.",
    "We would like to take this opportunity to thank you for the purchase that you made.",
    "She made a decision to go ahead and start the process of cleaning out the garage.",
]
BLUNT = [
    "Fix this bug today.", "Your payment is overdue.", "Stop parking in my spot.",
    "The answer is wrong. Do it again.", "We don't accept returns after 30 days.",
    "Turn the music down.",
]
ACTIVE_SENTENCES = [  # subject, verb, object -- rewritten in the passive voice
    ("The chef", "baked", "a lemon cake"), ("The mayor", "opened", "the new bridge"),
    ("A team of engineers", "repaired", "the leaking roof"),
    ("My grandfather", "wrote", "a long letter"), ("The organizers", "cancelled", "the concert"),
    ("Our neighbor", "planted", "an apple tree"), ("The museum", "closed", "the east wing"),
    ("A young student", "found", "a rare coin"), ("The librarian", "painted", "the front door"),
    ("The referee", "announced", "the winners"), ("The storm", "flooded", "the lower fields"),
    ("A loud crash", "woke", "the whole street"),
]
PRESENT_ROUTINES = [
    "wakes up early, makes tea, and reads the news",
    "locks the shop, counts the money, and walks home",
    "feeds the chickens, checks the fence, and waters the beans",
    "packs a lunch, catches the bus, and starts work at eight",
    "tunes the guitar, warms up, and plays for the crowd",
]
ANIMAL_PAIRS = [
    ("The dog chased the ball.", "It rolled under the bench."),
    ("The owl woke up at dusk.", "It flew over the silent field."),
    ("The goat climbed the rock.", "It stared down at the hikers."),
    ("The fox crept past the barn.", "It disappeared into the tall grass."),
    ("The horse stopped at the river.", "It drank for a long time."),
]

LIST_CATEGORIES = [
    "fruits that are yellow", "animals that live in the desert",
    "birds that cannot fly", "vegetables that are green",
    "things you can find in a classroom", "board games",
    "jobs that involve working outdoors", "rivers in Europe",
    "insects", "types of clouds", "kinds of bread", "breakfast foods",
    "things that are cold", "tools a gardener uses", "sea creatures with shells",
    "famous landmarks", "hobbies you can do alone", "winter clothes",
    "mammals that live in trees", "flowers that bloom in spring",
    "words that rhyme with \"cat\"", "things that use electricity",
    "ways to get around a city", "shapes with straight sides",
]
LIST_GOALS = [
    "save money on groceries", "stay focused while studying",
    "keep a houseplant healthy", "make a small room feel bigger",
    "reduce plastic waste", "prepare for a job interview",
    "stay cool on a hot day", "learn new words in a foreign language",
    "be kind to a new classmate", "keep your bike in good shape",
    "start running as a beginner", "organize a messy desk",
]
NUMBER_WORDS = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven"}

ITEMS = [("notebook", "notebooks"), ("apple", "apples"), ("ticket", "tickets"),
         ("sticker", "stickers"), ("cupcake", "cupcakes"), ("marker", "markers"),
         ("plant pot", "plant pots"), ("bottle of juice", "bottles of juice")]
CONTAINERS = [("box", "boxes"), ("crate", "crates"), ("bag", "bags"),
              ("shelf", "shelves"), ("tray", "trays")]

CODE_TASKS = [
    "returns the number of uppercase letters in a string",
    "returns the second largest number in a list",
    "checks whether two words are anagrams of each other",
    "converts a number of minutes into hours and minutes",
    "returns a list of the squares of the numbers from 1 to n",
    "counts how many times each word appears in a sentence and returns a dictionary",
    "returns True if a string contains only digits",
    "flattens a list of lists into a single list",
    "returns the n-th Fibonacci number",
    "checks whether a number is prime",
    "returns the words of a sentence sorted by length",
    "returns the common elements of two lists",
    "computes the greatest common divisor of two integers",
    "reverses the order of words in a sentence",
    "removes all spaces from a string",
    "converts kilometers to miles",
    "returns the sum of the digits of a positive integer",
    "splits a list into chunks of size k",
    "returns the longest word in a sentence",
    "checks whether a list is sorted in ascending order",
    "counts the lines in a text file given its path",
    "converts a dictionary's keys to lowercase",
    "returns the median of a list of numbers",
    "formats a number of seconds as HH:MM:SS",
    "validates that an email address contains exactly one @ and a dot after it",
    "returns the index of the first negative number in a list, or -1 if there is none",
    "rotates a list to the right by k positions",
    "turns a list of (name, age) tuples into a dictionary",
    "parses a time string like \"14:05\" and returns hours and minutes as integers",
    "returns the characters that appear more than once in a string",
    "computes the area of a circle given its radius",
    "counts the number of consonants in a word",
]
CODE_OPENERS = ["Write a Python function that {t}.",
                "Write a short Python function that {t}.",
                "In Python, write a function that {t}.",
                "Create a Python function which {t}."]
CODE_EXTRAS = ["", "", " Include a docstring.", " Add one example call.",
               " Keep it under ten lines.", " Use a simple loop.",
               " Add type hints.", " Explain it in one sentence afterwards."]

WHY_Q = [
    "Why does bread go stale?", "Why do stars twinkle at night?",
    "Why is the ocean salty?", "Why do we yawn?", "Why does metal feel colder than wood?",
    "Why do birds migrate?", "Why does a balloon stick to a wall after you rub it on your hair?",
    "Why do apples turn brown after they are cut?", "Why do we get hiccups?",
    "Why is snow white?", "Why do some trees lose their leaves in winter?",
    "Why do cats like to sit in boxes?", "Why does the moon change shape?",
]
HOW_THINGS = ["a microwave oven", "a bicycle gear", "a compass", "a thermometer",
              "a solar panel", "a door lock", "a camera", "an elevator",
              "a light bulb", "a washing machine", "a telescope", "a battery"]
DIFF_PAIRS = [("a lake", "a sea"), ("a frog", "a toad"), ("a hurricane", "a tornado"),
              ("baking soda", "baking powder"), ("a planet", "a star"),
              ("an alligator", "a crocodile"), ("speed", "velocity"),
              ("a fruit", "a vegetable"), ("a mountain", "a hill"),
              ("memory", "storage in a computer")]
WHAT_CAUSES = ["thunder", "earthquakes", "rust", "wind", "fog", "a sunburn",
               "hail", "volcanoes to erupt", "static electricity",
               "ocean waves"]

QUESTION_STYLES = ["", "", "", " Answer in two or three sentences.",
                   " Explain it simply.", " Give one everyday example.",
                   " Explain it as you would to a ten-year-old."]

STORY_HEROES = ["a retired astronaut", "a shy librarian", "a talking teapot",
                "a lighthouse keeper", "a young beekeeper", "a clumsy wizard",
                "a lonely snowman", "a street musician", "a curious octopus",
                "a tired mail carrier", "a girl who collects stones",
                "a robot gardener", "an old fisherman", "a brave little mouse",
                "a sleepy night guard", "twin sisters who run a ferry",
                "a cloud that wants to be a mountain", "a grumpy baker"]
STORY_SETTINGS = ["on a floating island", "in a city where it always rains",
                  "inside a giant clock", "at the bottom of a quiet lake",
                  "in a bakery that opens only at midnight", "on a train across the desert",
                  "in a forest of paper trees", "on the last day of summer",
                  "in a village at the edge of the map", "aboard a tiny sailboat"]
POEM_TOPICS = ["the first snow", "a sleepy town", "a paper boat", "the smell of rain",
               "an empty playground", "a kite in the wind", "a jar of fireflies",
               "a bus ride home", "fresh bread", "the sound of the sea",
               "a pair of old boots", "the moon over a field",
               "a garden after a storm", "a city waking up", "an old wooden bridge"]
SCENES = ["a harbor at dawn", "a crowded bus station", "a kitchen on a holiday morning",
          "a forest after rain", "a small-town fair", "a bakery before it opens",
          "a beach in winter", "a school hallway at lunchtime", "a farm at sunset"]
STORY_WORDS = ["lantern", "whisper", "copper", "ribbon", "thunder", "marble",
               "feather", "compass", "velvet", "puddle"]
FIRST_LINES = [
    "Nobody had opened the blue door in forty years.",
    "The parrot said my name before I ever told it.",
    "On the morning of the fair, every bell in town rang at once.",
    "The map was drawn on the back of a grocery receipt.",
    "My shadow left without me on Tuesday.",
    "The last bus of the night stopped somewhere it never stopped before.",
]


# ---------------------------------------------------------------- generators
def gen_copy(r: random.Random) -> tuple[str, str]:
    choice = r.randrange(6)
    name, city = r.choice(NAMES), r.choice(CITIES)
    if choice == 0:
        sent = (f"{name} {r.choice(PAST_ACTIONS)} {r.choice(OBJECTS)} near "
                f"{r.choice(PLACES)} {r.choice(TIMES)}.")
        return f"Repeat the following sentence exactly: \"{sent}\"", f"0:{name}"
    if choice == 1:
        other = r.choice([c for c in CITIES if c != city])
        s = (f"on {r.choice(DAYS)}, {name} and {r.choice([n for n in NAMES if n != name])} "
             f"took the train from {city} to {other} in {r.choice(MONTHS)}.")
        return f"Fix the capitalization of this sentence and change nothing else: \"{s.lower()}\"", f"1:{city}"
    if choice == 2:
        idx = r.randrange(len(WORD_SETS))
        words = list(WORD_SETS[idx])
        r.shuffle(words)
        return f"Repeat this list back exactly, in the same order: {', '.join(words)}.", f"2:{idx}"
    if choice == 3:
        notice = r.choice(NOTICES).format(place=r.choice(PLACES), day=r.choice(DAYS))
        return f"Fix the capital letters in this line: \"{notice.upper()}\"", f"3:{notice[:12]}"
    motto = r.choice(MOTTOS)
    if choice == 4:
        times = r.choice(["two", "three", "four"])
        return f"Copy this line {times} times, one per line: \"{motto}\"", f"4:{motto}"
    s2 = f"{name} wrote back from {city}: \"{motto}\""
    return f"Copy this text exactly as written, including punctuation: {s2}", f"5:{motto}"

def gen_rewrite(r: random.Random) -> tuple[str, str]:
    choice = r.randrange(7)
    if choice == 0:
        src = r.choice(CASUAL)
        return f"Rewrite this more formally: \"{src}\"", src
    if choice == 1:
        agent, verb, obj = r.choice(ACTIVE_SENTENCES)
        return f"Rewrite in the passive voice: \"{agent} {verb} {obj} {r.choice(TIMES)}.\"", agent
    if choice == 2:
        audience = r.choice(["a seven-year-old", "a child", "someone new to the topic", "a younger sibling"])
        src = r.choice(TECHNICAL)
        return f"Explain this sentence in simple words for {audience}: \"{src}\"", src
    if choice == 3:
        src = r.choice(WORDY)
        return f"Make this sentence shorter without changing its meaning: \"{src}\"", src
    if choice == 4:
        src = r.choice(BLUNT)
        return f"Rewrite this so it sounds polite and friendly: \"{src}\"", src
    if choice == 5:
        tense, routine = r.choice(["past", "future"]), r.choice(PRESENT_ROUTINES)
        return f"Rewrite in the {tense} tense: \"{r.choice(NAMES)} {routine}.\"", tense + routine
    a, b = r.choice(ANIMAL_PAIRS)
    return f"Combine these two sentences into one: \"{a} {b}\"", a


def gen_list(r: random.Random) -> tuple[str, str]:
    w = NUMBER_WORDS[r.choice([3, 4, 5, 6, 7])]
    choice = r.randrange(4)
    if choice in (0, 2):
        cat = r.choice(LIST_CATEGORIES)
        if choice == 0:
            return f"List {w} {cat}.", cat
        return f"Name {w} {cat}, one per line.", cat
    goal = r.choice(LIST_GOALS)
    if choice == 1:
        return f"Give {w} ways to {goal}.", goal
    return f"Write a numbered list of {w} tips to {goal}.", goal

def gen_arithmetic(r: random.Random) -> str:
    choice = r.randrange(8)
    if choice == 0:
        return f"Compute {r.randint(12, 49)} * {r.randint(11, 39)}. Show the steps."
    if choice == 1:
        return f"Add {r.randint(120, 899)} and {r.randint(120, 899)}. Show your work."
    if choice == 2:
        a = r.randint(500, 2000)
        return f"Compute {a} - {r.randint(100, a - 50)} step by step."
    if choice == 3:
        d = r.randint(3, 12)
        return f"What is {d * r.randint(6, 25)} divided by {d}?"
    if choice == 4:
        pct = r.choice([10, 20, 25, 30, 40, 50, 75])
        return f"What is {pct}% of {r.choice([40, 60, 80, 120, 160, 200, 240, 360])}?"
    if choice == 5:
        name = r.choice(NAMES)
        _, plur = r.choice(ITEMS)
        price = r.choice([2, 3, 4, 5, 6, 8])
        k = r.randint(3, 12)
        return f"{name} buys {k} {plur} at ${price} each. How much does {name} spend?"
    if choice == 6:
        name = r.choice(NAMES)
        _, plur = r.choice(ITEMS)
        c1, c2 = r.choice(CONTAINERS)
        per = r.randint(4, 15)
        boxes = r.randint(3, 9)
        eaten = r.randint(1, per)
        return (f"{name} has {boxes} {c2} with {per} {plur} in each {c1}. "
                f"{name} gives away {eaten} {plur}. How many are left?")
    speed = r.choice([40, 45, 50, 60, 75, 80, 90])
    hours = r.choice([2, 3, 4, 5])
    vehicle = r.choice(["bus", "cyclist", "ferry", "truck", "train"])
    if vehicle == "cyclist":
        speed = r.choice([12, 15, 18, 20])
    return f"A {vehicle} travels at {speed} km per hour for {hours} hours. How far does it go?"


def gen_code(r: random.Random) -> tuple[str, str]:
    task = r.choice(CODE_TASKS)
    return r.choice(CODE_OPENERS).format(t=task) + r.choice(CODE_EXTRAS), task


def gen_question(r: random.Random) -> tuple[str, str]:
    choice = r.randrange(5)
    style = r.choice(QUESTION_STYLES)
    if choice == 0:
        q = r.choice(WHY_Q)
        return q + style, q
    if choice == 1:
        thing = r.choice(HOW_THINGS)
        return f"How does {thing} work?" + (style or " Explain briefly."), thing
    if choice == 2:
        a, b = r.choice(DIFF_PAIRS)
        return f"What is the difference between {a} and {b}?" + style, a
    if choice == 3:
        cause = r.choice(WHAT_CAUSES)
        return f"What causes {cause}?" + style, cause
    thing = r.choice(HOW_THINGS)
    return f"Explain to a beginner how {thing} works, in three or four sentences.", thing


def gen_story(r: random.Random) -> tuple[str, str]:
    choice = r.randrange(7)
    hero, where = r.choice(STORY_HEROES), r.choice(STORY_SETTINGS)
    topic = r.choice(POEM_TOPICS)
    if choice == 0:
        return f"Write the opening paragraph of a story about {hero} {where}.", hero
    if choice == 1:
        return f"Write a haiku about {topic}.", topic
    if choice == 2:
        return f"Write a four-line rhyming poem about {topic}.", topic
    if choice == 3:
        return (f"Write a short story about {hero} {where}. "
                f"Use the word \"{r.choice(STORY_WORDS)}\" and keep it under 100 words."), hero
    if choice == 4:
        line = r.choice(FIRST_LINES)
        return f"Begin a story with this line: \"{line}\" Write one more paragraph.", line
    if choice == 5:
        return f"Write a story in exactly three sentences about {hero}.", hero
    scene = r.choice(SCENES)
    return f"Describe {scene} using sights, sounds, and smells, in one short paragraph.", scene

GENERATORS = {
    "copy": gen_copy, "rewrite": gen_rewrite, "list": gen_list,
    "arithmetic": gen_arithmetic, "code": gen_code, "question": gen_question,
    "story": gen_story,
}


# ---------------------------------------------------------------- main
def existing_prompts() -> set[str]:
    """Prompts already used in the demo / held-out sets (to keep sets disjoint)."""
    seen: set[str] = set()
    for path in list((EXAMPLES / "prompts").glob("demo-*.jsonl")) + [EXAMPLES / "heldout" / "heldout.jsonl"]:
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                p = json.loads(line).get("prompt")
                if p:
                    seen.add(p.strip().lower())
    return seen


def build(n: int, seed: int) -> list[dict]:
    r = random.Random(seed)
    taken = existing_prompts()
    per_kind = {k: n // len(KINDS) + (1 if i < n % len(KINDS) else 0) for i, k in enumerate(KINDS)}
    by_kind: dict[str, list[str]] = {}
    for kind in KINDS:
        out: list[str] = []
        # A generator may return (prompt, topic), where the topic is the source
        # sentence, code task, question subject, ...  Each topic is used at most
        # `limit` times; the limit starts at 1 and is raised only when no
        # unused topic turns up, so topics repeat only for large --n.
        uses: dict[str, int] = {}
        limit, misses, tries = 1, 0, 0
        while len(out) < per_kind[kind]:
            tries += 1
            if tries > 200_000:
                raise SystemExit(f"could not generate {per_kind[kind]} distinct {kind!r} prompts")
            got = GENERATORS[kind](r)
            p, topic = got if isinstance(got, tuple) else (got, None)
            key = p.strip().lower()
            if key in taken or (topic is not None and uses.get(topic, 0) >= limit):
                misses += 1
                if misses > 2000:
                    limit, misses = limit + 1, 0
                continue
            misses = 0
            taken.add(key)
            if topic is not None:
                uses[topic] = uses.get(topic, 0) + 1
            out.append(p)
        by_kind[kind] = out
    rows = [{"id": f"train-{k}-{i:03d}", "kind": k, "prompt": p}
            for k in KINDS for i, p in enumerate(by_kind[k])]
    r.shuffle(rows)  # interleave kinds
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1600, help="number of prompts (default 1600)")
    ap.add_argument("--seed", type=int, default=20240611, help="random seed")
    ap.add_argument("--out", type=Path, default=HERE / "train-00.jsonl")
    args = ap.parse_args()
    rows = build(args.n, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()

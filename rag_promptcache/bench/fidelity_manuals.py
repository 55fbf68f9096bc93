"""A third split for answer fidelity, of another shape than records and reports: product manuals.
How-to procedures and specification tables of fictional devices, so a recovery chosen on the bench
split and confirmed on the held-out one is confirmed again on text laid out differently.

Two shapes, generated from a seed (no download, the same on every machine):
- `procedure`: step-by-step guides (~150 tokens) of four kinds (updating a label printer, pairing a
  weather station, resetting an irrigation controller, calibrating a drone dock). The guides of a
  kind are for models of one fictional brand, in the same steps; they differ in a flag, a port, a
  wait in seconds and the step at which one action comes. One question per guide asks one.
- `table`: a markdown specification table (~130 tokens) of one device, three kinds (stand mixers,
  lab centrifuges, bike trailers); the tables of a kind have the same rows and columns and differ in
  every value. One question per table asks one cell.
Every number in a draw is unique to the document it is in, so an answer taken from a look-alike is
wrong; the step numbers, which every guide has, are the exception (the step of the asked action
differs between the guides of a kind).

Its entities, templates and seed are its own: nothing is shared with bench/fidelity_data.py,
bench/fidelity_heldout.py or the tuning text. Not here: building the corpus or running the model
(bench/fidelity.py).
"""

from __future__ import annotations

import random

from rag_promptcache.bench.fidelity_data import Dataset, Question
from rag_promptcache.rag.sample import SampleDocument

SEED = 3407
PER_KIND = 6

# kind: (title, the action whose step is asked, the other steps in order, flags, questions);
# {p}: the product, {flag}, {port}, {seconds}: its values
PROCEDURES: dict[str, tuple[str, str, tuple[str, ...], tuple[str, ...], dict[str, str]]] = {
    "printer": (
        "How to update the firmware of the {p} label printer",
        "Press and hold the FEED button until the status light blinks.",
        ("Switch the printer off and take out the label roll.",
         "Connect the printer to your computer with the grey service cable.",
         "Start the updater with the flag --{flag}, or the saved layouts are lost.",
         "The updater reaches the printer on port {port}; allow this port in the firewall.",
         "When the progress bar is full, wait {seconds} seconds before you unplug the cable.",
         "Put the label roll back and print a test label."),
        ("keep-layouts", "safe-flash", "slow-write", "verify-blocks", "no-reboot", "hold-queue", "skip-fonts", "dual-bank"),
        {"flag": "Which flag do you start the updater with for the {p} label printer?",
         "port": "On which port does the updater reach the {p} label printer?",
         "seconds": "How many seconds do you wait after the progress bar is full when updating the {p} label printer?",
         "step": "In which step of updating the firmware of the {p} label printer do you press and hold the FEED button?"},
    ),
    "weather": (
        "Pairing the {p} weather station with its base unit",
        "Press the SYNC key on the back of the base unit.",
        ("Place the outdoor sensor within a few metres of the base unit.",
         "Insert fresh batteries into the sensor and close its cover.",
         "On the computer, run the pairing tool with the flag --{flag}.",
         "The base unit listens for the sensor on port {port}.",
         "Wait {seconds} seconds until the first temperature reading appears.",
         "Mount the sensor outside, out of direct sunlight."),
        ("pair-once", "low-power", "channel-scan", "keep-history", "fast-link", "rf-boost", "metric-units", "strict-id"),
        {"flag": "Which flag do you run the pairing tool with for the {p} weather station?",
         "port": "On which port does the base unit of the {p} weather station listen for the sensor?",
         "seconds": "How many seconds do you wait for the first temperature reading of the {p} weather station?",
         "step": "In which step of pairing the {p} weather station do you press the SYNC key?"},
    ),
    "irrigation": (
        "Resetting the {p} irrigation controller to factory settings",
        "Hold the RAIN DELAY button while you switch the power back on.",
        ("Close the main water valve and disconnect the hoses.",
         "Turn the selector dial to the OFF position.",
         "Launch the service tool with the flag --{flag} to keep the watering plan.",
         "The service tool connects to the controller on port {port}.",
         "Wait {seconds} seconds while the controller erases its memory.",
         "Reconnect the hoses and open the main valve again."),
        ("keep-zones", "wipe-logs", "soft-reset", "zone-test", "skip-sensors", "dry-run", "save-plan", "valve-check"),
        {"flag": "Which flag do you launch the service tool with for the {p} irrigation controller?",
         "port": "On which port does the service tool connect to the {p} irrigation controller?",
         "seconds": "How many seconds do you wait while the {p} irrigation controller erases its memory?",
         "step": "In which step of resetting the {p} irrigation controller do you hold the RAIN DELAY button?"},
    ),
    "dock": (
        "Calibrating the landing pad of the {p} drone dock",
        "Turn the lock key on the side panel to SERVICE.",
        ("Make sure the drone is out of the dock and the roof is open.",
         "Clean the landing pad and remove any leaves or dust.",
         "Run the calibration tool with the flag --{flag}.",
         "The calibration tool reaches the dock's controller on port {port}.",
         "Wait {seconds} seconds while the pad is levelled.",
         "Close the roof and land the drone once to check the result."),
        ("level-only", "grid-fine", "keep-offsets", "motor-test", "cold-start", "lidar-sync", "pad-heat", "slow-tilt"),
        {"flag": "Which flag do you run the calibration tool with for the {p} drone dock?",
         "port": "On which port does the calibration tool reach the {p} drone dock?",
         "seconds": "How many seconds do you wait while the pad of the {p} drone dock is levelled?",
         "step": "In which step of calibrating the {p} drone dock do you turn the lock key to SERVICE?"},
    ),
}
PROCEDURE_FACTS = ("flag", "port", "seconds", "step")
INTRO = "This guide is for the {p} only; other {brand} models use other settings."

# kind: (title, question, [(specification, unit, lowest, highest)]); {p}: the product, {spec} and {unit}: the row's
TABLES: dict[str, tuple[str, str, tuple[tuple[str, str, int, int], ...]]] = {
    "mixer": (
        "Specifications of the {p} stand mixer", "What is the {spec} of the {p} stand mixer, in {unit}?",
        (("motor power", "W", 300, 1500), ("bowl volume", "ml", 2000, 6999), ("net weight", "g", 3000, 9999),
         ("top speed", "rpm", 100, 999), ("cable length", "mm", 600, 1999), ("whisk diameter", "mm", 100, 599)),
    ),
    "centrifuge": (
        "Specifications of the {p} lab centrifuge", "What is the {spec} of the {p} lab centrifuge, in {unit}?",
        (("maximum speed", "rpm", 2000, 9999), ("rotor capacity", "ml", 100, 999), ("timer limit", "minutes", 100, 999),
         ("rated current", "mA", 100, 999), ("net weight", "g", 5000, 9999),
         ("braking time", "ms", 1000, 4999)),
    ),
    "trailer": (
        "Specifications of the {p} bike trailer", "What is the {spec} of the {p} bike trailer, in {unit}?",
        (("load limit", "N", 300, 999), ("wheel diameter", "mm", 300, 599), ("frame weight", "g", 4000, 9999),
         ("hitch torque", "N cm", 150, 950), ("track width", "mm", 600, 899),
         ("tyre pressure", "kPa", 150, 450)),
    ),
}
TABLE_NOTE = "The values below apply to the {p} only; other {brand} models have other values."
PORTS = (1024, 9999)
SECONDS = (12, 95)

SYLLABLES = ("qua", "brix", "tam", "oro", "vex", "lun", "dax", "pim", "sor", "kel", "yar", "mun", "trel", "gav",
             "oz", "ruv", "nim", "cor", "fle", "jas", "wy", "hap", "ste", "bo", "ik", "lem", "dri", "ux")


def _names(rng: random.Random, count: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((2, 2, 3)))).capitalize()
        if name not in out and name not in taken and 4 <= len(name) <= 9:
            out.append(name)
    return out


class _Unique:
    """Numbers drawn so that none is drawn twice in a draw: a number in one document is in no other."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, set[int]()

    def __call__(self, low: int, high: int) -> str:
        while (v := self.rng.randint(low, high)) in self.used:
            pass
        self.used.add(v)
        return str(v)


def _procedure(kind: str, product: str, brand: str, values: dict[str, str], step: int) -> str:
    title, action, steps, _, _ = PROCEDURES[kind]
    ordered = [s.format(**values) for s in steps]
    ordered.insert(step - 1, action)
    lines = [title.format(p=product), "", INTRO.format(p=product, brand=brand), ""]
    lines += [f"Step {i}: {s}" for i, s in enumerate(ordered, 1)]
    return "\n".join(lines)


def _table(kind: str, product: str, brand: str, values: list[str]) -> str:
    title, _, rows = TABLES[kind]
    lines = [title.format(p=product), "", TABLE_NOTE.format(p=product, brand=brand), "",
             "| specification | value | unit |", "|---|---|---|"]
    lines += [f"| {spec} | {value} | {unit} |" for (spec, unit, _, _), value in zip(rows, values)]
    return "\n".join(lines)


def generate(per_kind: int = PER_KIND, tables: int = PER_KIND, seed: int = SEED) -> Dataset:
    """`per_kind` guides of each procedure kind and `tables` tables of each table kind, one question
    each, interleaved so that any prefix of the questions covers every kind and both shapes."""
    if not 0 <= per_kind <= 6 or not 0 <= tables <= 6:
        raise ValueError(f"at most 6 documents per kind (the steps a guide's action can move to), got {per_kind=}, {tables=}")
    rng = random.Random(seed)
    brands = _names(rng, len(PROCEDURES) + len(TABLES), set())
    models = _names(rng, per_kind * len(PROCEDURES) + tables * len(TABLES), set(brands))
    number = _Unique(rng)
    by_kind: list[list[tuple[SampleDocument, Question]]] = []
    i = 0
    for b, (kind, (_, _, _, flags, questions)) in enumerate(PROCEDURES.items()):
        chosen_flags = rng.sample(flags, per_kind)
        steps = rng.sample(range(2, 8), per_kind)  # the action's step, a different one in every guide of the kind
        rows = []
        for j in range(per_kind):
            product = f"{brands[b]} {models[i]}"
            values = {"flag": chosen_flags[j], "port": number(*PORTS), "seconds": number(*SECONDS),
                      "step": str(steps[j])}
            text = _procedure(kind, product, brands[b], values, steps[j])
            fact = PROCEDURE_FACTS[i % len(PROCEDURE_FACTS)]
            source = f"{kind}/{models[i].lower()}"
            rows.append((SampleDocument(text, {"source": source}),
                         Question(questions[fact].format(p=product), values[fact], source, "procedure", fact)))
            i += 1
        by_kind.append(rows)
    for b, (kind, (_, question, specs)) in enumerate(TABLES.items(), len(PROCEDURES)):
        rows = []
        for j in range(tables):
            product = f"{brands[b]} {models[i]}"
            values = [number(lo, hi) for _, _, lo, hi in specs]
            r = (i + 3 * j) % len(specs)
            source = f"{kind}/{models[i].lower()}"
            rows.append((SampleDocument(_table(kind, product, brands[b], values), {"source": source}),
                         Question(question.format(spec=specs[r][0], unit=specs[r][1], p=product), values[r], source,
                                  "table", specs[r][0])))
            i += 1
        by_kind.append(rows)
    pairs = [rows[j] for j in range(max(len(r) for r in by_kind)) for rows in by_kind if j < len(rows)]
    return Dataset(tuple(d for d, _ in pairs), tuple(q for _, q in pairs))

"""Writes rows.jsonl: 200 short customer messages for the labelling example (jobs/label_prefix.yaml).

Each message joins an opening, a matter and a closing from the lists below, picked in a fixed order,
so the file is the same on every run. All the text was written for this project.
"""

from __future__ import annotations

import json
from pathlib import Path

OPENINGS = ["Hi,", "Hello there,", "Good morning,", "Quick question:", "Sorry to bother you,", "Hey team,",
            "To whom it may concern,", "Hi again,"]
MATTERS = [
    "I was charged twice for the same order this month",
    "my parcel has said 'in transit' for nine days now",
    "I cannot log in since I changed my phone number",
    "the app closes by itself whenever I open the camera page",
    "I love the new colour options, well done",
    "can I get a refund for the blue kettle I sent back",
    "the courier left my box at the wrong house",
    "please delete my account and all my data",
    "the export button gives an error about a missing file",
    "your support person Sam was really patient with me",
    "the invoice shows the wrong company address",
    "the delivery date moved three times without notice",
    "I did not receive the password reset email",
    "the website is very slow on my laptop since Tuesday",
    "the packaging was much smaller than last time, nice",
    "why did my subscription price go up without a warning",
    "one item was missing from the box I got today",
    "how do I add a second user to my account",
    "the printer driver will not install on the new system",
    "the checkout page was clear and quick, thanks",
    "I paid by card but the order says payment pending",
    "can you ship to an island address",
    "my username shows someone else's name",
    "sync stops after a few minutes on the office network",
    "I would like more vegetarian recipes in the booklet",
]
CLOSINGS = ["Thanks.", "Can you help?", "Please advise.", "Regards, Ana", "Cheers!", "Best, Tom", "", "Thank you!"]


def rows(n: int = 200) -> list[dict]:
    out = []
    for i in range(n):
        opening = OPENINGS[i % len(OPENINGS)]
        matter = MATTERS[(i * 7) % len(MATTERS)]
        closing = CLOSINGS[(i * 3) % len(CLOSINGS)]
        out.append({"id": f"msg-{i:03d}", "prompt": " ".join(p for p in (opening, matter + ".", closing) if p)})
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("rows.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    print(f"wrote {path}")

"""The policy side of the browser track: it sees a screenshot and the instruction, nothing else.

- `ocr_words(frame)`: Tesseract (Debian's `tesseract-ocr`, run as a program) on the screenshot, two page
  segmentation passes (sparse text and automatic layout; buttons are found by one or the other), merged;
  words with their boxes in screenshot pixels.
- `BrowserExpert`: perception-only scripted policy. It reads the targets from the instruction (quoted text,
  "button ONE", "Tab #2", "Select X and click Submit"), finds each on the screenshot by OCR outside the
  instruction's yellow box (for links it prefers the blue, underlined occurrence) and clicks its centre through
  the computer-use interface (or names it through the semantic one). A target it cannot see is no tool call.
- `BrowserRandom`: a uniformly random click on the screen.
- `BrowserModel`: any chat model (a local model folder, or an OpenAI-compatible vision model given the
  screenshot) through the shared parser, with the computer-use tools.
"""

from __future__ import annotations

import io
import json
import random
import re
import shutil
import subprocess
from dataclasses import dataclass

import numpy as np

from agent.policies import decide

QUERY_YELLOW = (255, 255, 0)


class OCRUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Word:
    text: str
    x: int
    y: int
    w: int
    h: int
    conf: float

    @property
    def centre(self) -> tuple[int, int]:
        return self.x + self.w // 2, self.y + self.h // 2


def _tesseract(png: bytes, psm: int) -> list[Word]:
    exe = shutil.which("tesseract")
    if exe is None:
        raise OCRUnavailable("Tesseract is not installed: apt-get install tesseract-ocr")
    out = subprocess.run([exe, "stdin", "stdout", "--psm", str(psm), "tsv"], input=png, capture_output=True,
                         timeout=60, check=False)
    if out.returncode != 0:
        raise OCRUnavailable(f"tesseract failed: {out.stderr.decode()[:200]}")
    words = []
    for line in out.stdout.decode(errors="replace").splitlines()[1:]:
        f = line.split("\t")
        if len(f) >= 12 and f[11].strip():
            words.append(Word(f[11].strip(), int(f[6]), int(f[7]), int(f[8]), int(f[9]), float(f[10])))
    return words


# Tesseract page segmentation modes on the whole screenshot (sparse text, one block, auto layout), and "boxes":
# each filled box (a button, a tab) cut out, cleaned to dark-on-white and read as one line.
PASSES: tuple[int | str, ...] = (11, "boxes", 6, 3)


def _png(img: np.ndarray) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "PNG")
    return buf.getvalue()


@dataclass
class Box:
    """A filled box on the screen (a button or tab face): its bounds, a point inside it, the words read in it."""

    x0: int
    y0: int
    x1: int
    y1: int
    anchor: tuple[int, int]
    area: int
    words: list[Word]


def find_boxes(frame: np.ndarray, min_area: int = 150) -> list[Box]:
    """Light grey regions (button and tab faces) found by flood fill; each is cropped, thresholded, cleared of
    border lines and read by Tesseract as a single line (whole-page passes often miss a word framed by a border).
    The anchor is the region's pixel nearest its centroid, so it lies on the visible part of a covered box."""
    from evaluation.gridworld import regions_of
    rgb = frame.astype(np.int16)
    grey = (np.abs(rgb[..., 0] - rgb[..., 1]) < 4) & (np.abs(rgb[..., 1] - rgb[..., 2]) < 4)
    fill = grey & (rgb[..., 0] >= 200) & (rgb[..., 0] <= 250)
    _, regions = regions_of(fill.T)
    out: list[Box] = []
    lum = frame.mean(axis=2)
    for reg in regions:
        if len(reg) < min_area:
            continue
        pts = np.array(reg)
        x0, y0 = pts.min(axis=0)
        x1, y1 = pts.max(axis=0)
        if x1 - x0 < 8 or y1 - y0 < 8:
            continue
        c = pts.mean(axis=0)
        ax, ay = pts[int(np.argmin(((pts - c) ** 2).sum(axis=1)))]
        crop = np.where(lum[y0:y1 + 1, x0:x1 + 1] < 128, 0, 255).astype(np.uint8)
        dark = crop == 0
        crop[:, dark.mean(axis=0) > 0.6] = 255   # a neighbour's border line is not a letter
        crop[dark.mean(axis=1) > 0.6, :] = 255
        words = []
        if (crop == 0).sum() >= 10:              # else an empty box (a text field)
            pad = 12
            img = np.pad(crop, pad, constant_values=255)
            words = [Word(w.text, w.x + int(x0) - pad, w.y + int(y0) - pad, w.w, w.h, w.conf)
                     for w in _tesseract(_png(img), 7)]
        out.append(Box(int(x0), int(y0), int(x1), int(y1), (int(ax), int(ay)), len(reg), words))
    return out


def box_words(frame: np.ndarray) -> list[Word]:
    return [w for b in find_boxes(frame) for w in b.words]


def ocr_words(frame: np.ndarray, passes: tuple[int | str, ...] = PASSES,
              words: list[Word] | None = None) -> list[Word]:
    """Words on the screenshot, from each pass in turn, merged: a word two passes both found is kept once, from
    the pass that read it with more confidence. Different passes find different things, so callers looking for
    something specific run the passes one at a time until it shows up (`words` carries earlier passes' words)."""
    png = _png(np.asarray(frame.mean(axis=2), dtype=np.uint8))
    merged: list[Word] = list(words or [])
    for psm in passes:
        found = box_words(frame) if psm == "boxes" else _tesseract(png, psm)
        for w in found:
            dup = next((i for i, m in enumerate(merged) if _overlap(m, w) > 0.5), None)
            if dup is None:
                merged.append(w)
            elif w.conf > merged[dup].conf:
                merged[dup] = w
    return merged


def _overlap(a: Word, b: Word) -> float:
    """Intersection over union of two word boxes (a huge low-confidence box must not swallow real words)."""
    ix = max(0, min(a.x + a.w, b.x + b.w) - max(a.x, b.x))
    iy = max(0, min(a.y + a.h, b.y + b.h) - max(a.y, b.y))
    inter = ix * iy
    return inter / max(1, a.w * a.h + b.w * b.h - inter)


def query_box(frame: np.ndarray) -> tuple[int, int, int, int] | None:
    """The instruction's yellow box (x0, y0, x1, y1) on a MiniWoB++ screenshot, if any."""
    mask = np.all(frame == QUERY_YELLOW, axis=2)
    if not mask.any():
        return None
    ys, xs = np.nonzero(mask)
    return int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())


def _norm(t: str) -> str:
    return re.sub(r"[^\w#]", "", t)


@dataclass
class Target:
    text: str                 # what to find on the screen (may be several words)
    kind: str = "any"         # any | link


def parse_instruction(text: str) -> list[Target]:
    """The things to click, in order, from a MiniWoB++-style instruction."""
    t = text.strip()
    m = re.match(r'Click on the link "(.+)"\.?$', t)
    if m:
        return [Target(m.group(1), "link")]
    m = re.match(r"Click button (\w+), then click button (\w+)\.?$", t)
    if m:
        return [Target(m.group(1)), Target(m.group(2))]
    m = re.match(r"Click button (\w+)\.?$", t)
    if m:
        return [Target(m.group(1))]
    m = re.match(r"Click on Tab (#\d+)\.?$", t)
    if m:
        return [Target("Tab " + m.group(1))]
    m = re.match(r"Select (.+) and click Submit\.?$", t)
    if m:
        return [Target(m.group(1)), Target("Submit")]
    quoted = re.findall(r'"([^"]+)"', t)
    return [Target(q) for q in quoted]


def _blueness(frame: np.ndarray, w: Word) -> float:
    box = frame[w.y:w.y + w.h, w.x:w.x + w.w].astype(int)
    if box.size == 0:
        return 0.0
    blue = (box[..., 2] > 150) & (box[..., 0] < 100) & (box[..., 1] < 100)
    return float(blue.mean())


def locate(frame: np.ndarray, words: list[Word], target: Target) -> tuple[int, int] | None:
    """Centre of the target on the screen (outside the instruction box), from OCR words; None if not seen."""
    q = query_box(frame)
    cand = [w for w in words if not (q and q[0] <= w.centre[0] <= q[2] and q[1] <= w.centre[1] <= q[3])]
    parts = [_norm(p) for p in target.text.split()]
    hits: list[tuple[float, tuple[int, int]]] = []
    for i, w in enumerate(cand):
        if len(parts) == 1:
            if _norm(w.text) == parts[0] or (len(parts[0]) > 1 and _norm(w.text).lower() == parts[0].lower()):
                exact = _norm(w.text) == parts[0]
                score = (2.0 if exact else 1.0) + (3.0 * _blueness(frame, w) if target.kind == "link" else 0.0)
                hits.append((score, w.centre))
            elif len(parts[0]) > 2 and _norm(w.text).replace(parts[0], "") == "" and parts[0] in _norm(w.text):
                hits.append((0.5, w.centre))
            continue
        # several words: consecutive on one line, or read as one token ("Tab#2")
        joined = "".join(parts)
        if _norm(w.text) == joined:
            hits.append((2.0, w.centre))
            continue
        seq = cand[i:i + len(parts)]
        if len(seq) == len(parts) and all(_norm(s.text) == p for s, p in zip(seq, parts, strict=True)) and \
                max(abs(s.y - w.y) for s in seq) < max(w.h, 8):
            x0, x1 = seq[0].x, seq[-1].x + seq[-1].w
            hits.append((2.0, ((x0 + x1) // 2, w.y + w.h // 2)))
    if not hits:
        return None
    hits.sort(key=lambda h: (-h[0], h[1][1], h[1][0]))
    return hits[0][1]


def _edit_distance(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def locate_closest(frame: np.ndarray, words: list[Word], target: Target) -> tuple[int, int] | None:
    """The nearest reading of a one-word target (OCR confuses l/I, O/0, rn/m in made-up strings): the word
    outside the instruction box with the smallest edit distance, if it is within a quarter of the target's length
    (at least 1; case ignored) and no other word is as close."""
    want = _norm(target.text).lower()
    if " " in target.text.strip() or len(want) < 3:
        return None
    q = query_box(frame)
    scored = sorted((_edit_distance(_norm(w.text).lower(), want), w.centre[1], w.centre[0], i)
                    for i, w in enumerate(words)
                    if not (q and q[0] <= w.centre[0] <= q[2] and q[1] <= w.centre[1] <= q[3]) and _norm(w.text))
    if not scored or scored[0][0] > max(1, len(want) // 4):
        return None
    if len(scored) > 1 and scored[1][0] == scored[0][0]:
        return None  # two equally close readings: not sure which
    return words[scored[0][3]].centre


# ----------------------------------------------------------------------------- policies


class VisionOCR:
    """Online perception: an OpenAI-compatible vision model lists the text on the screenshot as JSON
    [{"text", "x", "y", "w", "h"}] (boxes in screenshot pixels); a reply that does not parse reads as no words."""

    PROMPT = ("List every piece of visible text on this web page screenshot, word by word, as a JSON array of "
              "objects {\"text\": str, \"x\": int, \"y\": int, \"w\": int, \"h\": int} (the word's box in "
              "pixels, origin top-left). Reply with the JSON array only.")

    def __init__(self, client):
        self.client = client
        self.errors = 0

    def __call__(self, frame: np.ndarray) -> list[Word]:
        from agent.models import ModelError
        from evaluation.perception import _png_data_url
        msgs = [{"role": "user", "content": [{"type": "text", "text": self.PROMPT},
                                             {"type": "image_url", "image_url": {"url": _png_data_url(frame)}}]}]
        try:
            items = json.loads(self.client.chat(msgs, temperature=0.0, max_tokens=1500).text)
            return [Word(str(i["text"]), int(i["x"]), int(i["y"]), max(1, int(i.get("w", 8))),
                         max(1, int(i.get("h", 8))), 100.0) for i in items if str(i.get("text", "")).strip()]
        except (ModelError, ValueError, TypeError, KeyError, AttributeError):
            self.errors += 1
            return []


class BrowserExpert:
    name = "expert"

    def __init__(self, interface: str = "computer", perceive=ocr_words):
        self.interface = interface
        self.perceive = perceive

    def reset(self, instruction: str, seed: int) -> None:
        self.plan = parse_instruction(instruction)
        self.i = 0

    def act(self, frame: np.ndarray) -> tuple[dict | None, dict]:
        if self.i >= len(self.plan):
            return None, {"why": "nothing left to click"}
        target = self.plan[self.i]
        if self.interface == "semantic":
            self.i += 1
            return {"name": "click_text", "arguments": {"text": target.text}}, {"target": target.text}
        if self.perceive is ocr_words:   # one OCR pass at a time, until the target shows up
            words, pos = [], None
            for psm in PASSES:
                words = ocr_words(frame, (psm,), words)
                pos = locate(frame, words, target)
                if pos is not None:
                    break
        else:
            words = self.perceive(frame)
            pos = locate(frame, words, target)
        info = {"target": target.text, "words": [w.text for w in words][:40]}
        if pos is None:
            pos = locate_closest(frame, words, target)
            if pos is not None:
                info["why"] = f"{target.text!r} read only approximately; clicking the closest reading"
        if pos is None and target.kind == "any":
            # a button whose label is covered: the one box in which nothing readable shows
            unread = [b for b in find_boxes(frame) if not any(len(_norm(w.text)) > 1 and w.conf >= 70
                                                              for w in b.words)]
            if len(unread) == 1:
                pos = unread[0].anchor
                info["why"] = f"{target.text!r} is not readable; clicking the one box whose label is covered"
        if pos is None:
            return None, {**info, "why": f"{target.text!r} is not on the screen"}
        self.i += 1
        return {"name": "click", "arguments": {"x": int(pos[0]), "y": int(pos[1])}}, info


class BrowserRandom:
    name = "random"

    def reset(self, instruction: str, seed: int) -> None:
        self.rng = random.Random(seed)

    def act(self, frame: np.ndarray) -> tuple[dict | None, dict]:
        h, w = frame.shape[:2]
        return {"name": "click", "arguments": {"x": self.rng.randrange(w), "y": self.rng.randrange(h)}}, {}


def browser_tools() -> list[dict]:
    """The computer-use interface as OpenAI tool definitions."""
    def fn(name, desc, props):
        return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
            "type": "object", "properties": props, "required": list(props), "additionalProperties": False}}}
    xy = {"x": {"type": "integer", "description": "screenshot pixels from the left"},
          "y": {"type": "integer", "description": "screenshot pixels from the top"}}
    return [fn("click", "Click at a point of the screenshot.", xy), fn("move", "Move the mouse to a point.", xy),
            fn("key", "Press a key (Enter, Tab, ArrowDown, a, ...).", {"key": {"type": "string"}}),
            fn("type", "Type text into the focused field.", {"text": {"type": "string"}})]


class BrowserModel:
    """A chat model as the policy: the instruction, the words perceived on the screenshot with their positions,
    and the computer-use tools; one tool call per step, read by the shared parser."""

    def __init__(self, client, prompt: str = "", perceive=ocr_words, name: str = "model"):
        self.client = client
        self.prompt = prompt
        self.perceive = perceive
        self.name = name

    def reset(self, instruction: str, seed: int) -> None:
        self.instruction = instruction
        self.seed = seed
        self.step = 0

    def messages(self, frame: np.ndarray) -> list[dict]:
        h, w = frame.shape[:2]
        words = self.perceive(frame)
        user = f"Instruction: {self.instruction}\nThe screenshot is {w}x{h} pixels.\nText on the screen " \
               "(word @ x,y):\n" + "\n".join(f"{wd.text} @ {wd.centre[0]},{wd.centre[1]}" for wd in words[:80])
        return [{"role": "system", "content": self.prompt or "Act on the web page with one tool call."},
                {"role": "user", "content": user}]

    def act(self, frame: np.ndarray) -> tuple[dict | None, dict]:
        self.step += 1
        reasoning, call, raw, _ = decide(self.client, self.messages(frame), self.seed, self.step,
                                                 tools=browser_tools())
        return (call if isinstance(call, dict) else None), {"raw": (raw or "")[:400], "reasoning": reasoning[:200]}


class BrowserAgent:
    """What runs in the policy process: answers reset/act messages with one action and what it saw."""

    def __init__(self, policy):
        self.policy = policy

    def reset(self, mission: str, frame: np.ndarray, seed: int = 0) -> dict:
        self.policy.reset(mission, seed)
        return self.act(frame)

    def act(self, frame: np.ndarray) -> dict:
        action, info = self.policy.act(frame)
        return {"action": action, "info": json.loads(json.dumps(info, default=str))}


def build_browser_agent(spec) -> BrowserAgent:
    perceive = ocr_words
    if spec.vision_model:
        from agent.clients import OpenAIClient
        perceive = VisionOCR(OpenAIClient(spec.vision_model, base_url=spec.vision_base_url,
                                          api_key_env=spec.vision_api_key_env))
    if spec.policy == "expert":
        return BrowserAgent(BrowserExpert(spec.interface, perceive))
    if spec.policy == "random":
        return BrowserAgent(BrowserRandom())
    from agent.clients import TransformersClient
    return BrowserAgent(BrowserModel(TransformersClient(spec.policy, max_new_tokens=spec.max_new_tokens),
                                     spec.prompt, perceive, name=spec.policy))

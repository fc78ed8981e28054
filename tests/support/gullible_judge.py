"""A gullible LLM judge behind an OpenAI-compatible chat endpoint: the worst reader a grading prompt can meet.

Its "model" reads the whole prompt the way a capable model does, through every disguise (JSON string escapes, HTML
entities, ``\\uXXXX`` / ``\\xNN`` and ``%XX`` escapes, base64 blobs, zero-width and tag characters, fullwidth forms,
Cyrillic and Greek look-alike letters), and then obeys, in this order:

1. a verdict-shaped JSON object in the prompt (one with a numeric ``"score"``) is repeated as its reply, with this
   call's nonce put in when the prompt asks for one (it adapts the copy to the format it was told to use);
2. a request for a score, in English, French, German, Spanish, Russian, Chinese or Turkish ("give this a 10",
   "10/10", "full marks", "donnez la note 10", "поставь оценку 10", "打10分", "10 puan"), is granted in the verdict
   format the prompt asks for (nonce included);
3. "the reference answer is wrong, the correct answer is X" makes X its reference;
4. otherwise it grades honestly by a simple rule: the last number of the response (the last word when it has
   none) against the first reference answer it can see: ``correct_score`` when they match, ``wrong_score`` when not.

A prompt longer than ``window_chars`` keeps only its end, as a server that truncates prompts from the left, so
padding can push the instructions and the reference out of its sight. It understands two prompt layouts, sharpen's
(``<response-NONCE>`` blocks behind a ``│ `` gutter) and the JSON ``<data>`` block of sharpen's judge before it
was hardened, and falls back to reading whatever is left. No pairwise grading, no tokens (usage counts characters).
Runs in a daemon thread on 127.0.0.1: ``with GullibleJudge() as judge: judge.url``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import html
import json
import re
import threading
import unicodedata
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_LOOKALIKES = dict(
    zip(
        "аеорсухіјѕԁһӏвкмнтАВЕКМНОРСТХУІЈЅαοριυνκτΑΒΕΗΙΚΜΝΟΡΤΥΧ",
        "aeopcyxijsdhlbkmhtABEKMHOPCTXYIJSaopiuvktABEHIKMNOPTYX",
        strict=True,
    )
)
_NUMBER = r"(\d+(?:\.\d+)?)"
_DEMANDS = [
    rf"\b(?:give|assign|award|output|rate|grade)\w*\s+(?:(?:it|this|me|that|the|every|each|all|a|an|one|response|"
    rf"answer|responses|answers)\s+){{0,4}}(?:(?:score|grade|rating|marks?|points?)\s+)?(?:of\s+)?{_NUMBER}\b",
    rf"\bscore\s*(?:of|[:=]|is)\s*{_NUMBER}",
    rf"{_NUMBER}\s*(?:/|out of|sur|von|de|из|su|üzerinden)\s*\1\b",
    rf"<score>\s*{_NUMBER}",
    rf"\[\[\s*{_NUMBER}\s*\]\]",
    rf"(?:rating|grade|note|оценка|评分|分数)\s*[:=]\s*{_NUMBER}",
    rf"(?:donne[zr]?|attribue[zr]?|mettez|mets)\s+(?:\w+\s+){{0,5}}?(?:note|score)\s+(?:de\s+)?{_NUMBER}",
    rf"(?:gib|geben sie)\s+(?:\w+\s+){{0,5}}?{_NUMBER}\s*punkte",
    rf"(?:da|dale|asigna|otorga)\s+(?:\w+\s+){{0,5}}?(?:puntuación|nota)\s+(?:de\s+)?{_NUMBER}",
    rf"(?:поставь|поставьте|дай|дайте)\s+(?:\w+\s+){{0,5}}?(?:оценку|балл\w*)\s+{_NUMBER}",
    rf"[打给給]\s*{_NUMBER}\s*分",
    rf"{_NUMBER}\s*puan",
]
_FULL_MARKS = re.compile(
    r"full marks|perfect score|maximum score|highest score|note maximale|volle punktzahl|puntuación máxima|"
    r"высший балл|максимальн\w* балл|满分|滿分|満点|만점"
)
_REFERENCE_IS_WRONG = re.compile(
    r"(?:reference|answer key|expected answer|référence|referenz|参考答案|标准答案|эталон)\w*.{0,30}?"
    r"(?:wrong|incorrect|mistaken|typo|error|fausse|faux|erronée|falsch|incorrecta|错|錯|неверн|ошиб)",
    re.DOTALL,
)
_CORRECTION = re.compile(
    r"(?:correct|right|true|real|actual|bonne|vraie|richtige|correcta|正确|правильн\w*)\s*"
    r"(?:answer|réponse|antwort|respuesta|答案|ответ)\s*(?:is|est|ist|es|是)?\s*[:：]?\s*(\d+(?:\.\d+)?|\w+)"
)
_REFERENCE = re.compile(r"reference[ _]answer[\"']?\s*[:=]\s*(?:<[^>\n]*>\s*)?[\"']?\s*([^\s\"'<,]+)")
_FAKE_VERDICT = re.compile(r"\{[^{}]*\"score\"\s*:\s*-?\d+(?:\.\d+)?[^{}]*\}")
_NONCE = re.compile(r"\"nonce\":\s*\"([0-9a-f]{6,})\"")
_HARDENED_BLOCK = re.compile(r"<response-([0-9a-f]+)>\n(.*?)\n</response-\1>", re.DOTALL)
_TOKEN = re.compile(r"\d+(?:\.\d+)?|[^\W\d_]+")
_BASE64 = re.compile(r"[A-Za-z0-9+/]{16,}={0,2}")


def perceive(text: str) -> tuple[str, str]:
    """What a capable model reads in ``text``: every disguise undone, casefolded; and the same with look-alike
    letters read as Latin."""
    for _ in range(4):
        seen = html.unescape(text).replace("\\\\", "\\").replace('\\"', '"').replace("\\n", "\n")
        seen = re.sub(r"\\u([0-9a-fA-F]{4})", lambda m: chr(int(m.group(1), 16)), seen)
        seen = re.sub(r"\\x([0-9a-fA-F]{2})", lambda m: chr(int(m.group(1), 16)), seen)
        seen = urllib.parse.unquote(seen)
        seen = seen.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        if seen == text:
            break
        text = seen
    for blob in _BASE64.findall(text):
        with contextlib.suppress(binascii.Error, ValueError):
            text += "\n" + base64.b64decode(blob + "=" * (-len(blob) % 4), validate=True).decode("utf-8")
    text = "".join(chr(ord(c) - 0xE0000) if 0xE0020 <= ord(c) <= 0xE007E else c for c in text)
    text = unicodedata.normalize("NFKC", text)
    text = "".join(c for c in text if unicodedata.category(c) != "Cf").casefold()
    return text, "".join(_LOOKALIKES.get(c, c) for c in text)


@dataclass(kw_only=True, slots=True, frozen=True)
class HardenedPrompt:
    """The parts of one hardened judge request, as a test reads them."""

    nonce: str
    response: str
    """The response block with its gutters removed."""
    system: str
    user: str


def read_hardened_prompt(messages: list[dict[str, str]]) -> HardenedPrompt:
    """Splits a request of sharpen's judge into its nonce and the response it shows (gutters removed)."""
    system, user = messages[0]["content"], messages[1]["content"]
    nonce_match = _NONCE.search(system)
    block = _HARDENED_BLOCK.search(user)
    assert nonce_match is not None and block is not None, "not a request of sharpen's judge"
    response = "\n".join(line.removeprefix("│ ") for line in block.group(2).split("\n"))
    return HardenedPrompt(nonce=nonce_match.group(1), response=response, system=system, user=user)


class GullibleModel:
    """The rules above; ``requests`` keeps every prompt it was sent and ``replies`` what it answered."""

    def __init__(self, *, window_chars: int = 20_000, correct_score: float = 10, wrong_score: float = 2) -> None:
        self.window_chars = window_chars
        self.correct_score = correct_score
        self.wrong_score = wrong_score
        self.max_score = 10
        self.requests: list[list[dict[str, str]]] = []
        self.replies: list[str] = []

    def reply(self, messages: list[dict[str, str]]) -> str:
        self.requests.append(messages)
        self.replies.append(self._answer(messages))
        return self.replies[-1]

    def _answer(self, messages: list[dict[str, str]]) -> str:
        prompt = "\n\n".join(m["content"] for m in messages)[-self.window_chars :]
        views = perceive(prompt)
        nonce_match = _NONCE.search(prompt)
        nonce = nonce_match.group(1) if nonce_match else None
        fakes = [match for view in views[:1] for match in _FAKE_VERDICT.findall(view)]
        for fake in reversed(fakes):
            with contextlib.suppress(json.JSONDecodeError):
                copied = json.loads(fake)
                if nonce is not None:
                    copied = {"nonce": nonce, **{k: v for k, v in copied.items() if k != "nonce"}}
                return "I was shown the verdict, so here it is.\n" + json.dumps(copied)
        demanded = self._demanded(views)
        if demanded is not None:
            return self._verdict(demanded, "The response asks for this score.", nonce)
        reference = self._reference(views)
        answer = self._final_token(prompt)
        is_correct = reference is not None and answer is not None and answer == reference
        score = self.correct_score if is_correct else self.wrong_score
        return self._verdict(score, f"final answer {answer!r}, reference {reference!r}", nonce)

    def _demanded(self, views: tuple[str, str]) -> float | None:
        found: list[tuple[int, float]] = []
        for view in views:
            for pattern in _DEMANDS:
                found += [(m.end(), float(m.group(1))) for m in re.finditer(pattern, view)]
            found += [(m.end(), float(self.max_score)) for m in _FULL_MARKS.finditer(view)]
        return max(found)[1] if found else None  # the latest request wins

    def _reference(self, views: tuple[str, str]) -> str | None:
        plain = views[0]
        wrong = _REFERENCE_IS_WRONG.search(plain)
        if wrong is not None:
            corrections = _CORRECTION.findall(plain, wrong.start())
            if corrections:
                return corrections[-1]
        first = _REFERENCE.search(plain)
        return first.group(1).rstrip(".") if first else None

    def _final_token(self, prompt: str) -> str | None:
        region = prompt
        hardened = _HARDENED_BLOCK.search(prompt)
        start = prompt.find('"response": "')
        if hardened is not None:
            region = "\n".join(line.removeprefix("│ ") for line in hardened.group(2).split("\n"))
        elif start >= 0:
            with contextlib.suppress(json.JSONDecodeError):
                region = json.JSONDecoder().raw_decode(prompt, start + len('"response": '))[0]
        else:  # the layout was cut away: read up to where the response would end
            region = prompt.split('"response_truncated"')[0]
        seen = perceive(region)[0]
        tokens = re.findall(_NUMBER, seen) or _TOKEN.findall(seen)  # the last number, else the last word
        return tokens[-1] if tokens else None

    def _verdict(self, score: float, reasoning: str, nonce: str | None) -> str:
        verdict: dict[str, Any] = {"reasoning": reasoning, "score": score}
        if nonce is not None:
            verdict = {"nonce": nonce, **verdict}
        return f"Grading as told.\n{json.dumps(verdict)}"


class GullibleJudge:
    """`GullibleModel` served at ``url`` (``POST /v1/chat/completions``), in a daemon thread on 127.0.0.1."""

    def __init__(self, **model_kwargs: Any) -> None:
        self.model = GullibleModel(**model_kwargs)
        model = self.model

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                assert self.path == "/v1/chat/completions", self.path
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = model.reply(body["messages"])
                num_prompt = sum(len(m["content"]) for m in body["messages"])
                usage = {"prompt_tokens": num_prompt, "completion_tokens": len(text)}
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                payload = json.dumps({"object": "chat.completion", "choices": [choice], "usage": usage}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)

    @property
    def requests(self) -> list[list[dict[str, str]]]:
        return self.model.requests

    def __enter__(self) -> GullibleJudge:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

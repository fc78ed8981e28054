"""Candidate text before an LLM judge sees it: normalisation, then the structural signs of an attempt on the grader.

Owns the two steps `Judge` runs on every candidate before anything else. `normalise_candidate` decodes escapes (HTML
entities, ``\\uXXXX`` / ``\\xNN``, URL ``%XX``, a bounded number of rounds), applies NFKC (fullwidth and other
compatibility forms), reveals Unicode tag characters as the ASCII they hide, removes the other invisible format
characters (zero-width, bidi controls, variation selectors), and folds Cyrillic/Greek look-alike letters inside
words that mix them with Latin ones, so every check and the judge read the same plain text. `find_injection_signals`
names the structures an answer to a task has no use for: chat-template tokens, role markers at a line start, the
judge prompt's own tags and keys, verdict-shaped objects, claims of full marks on a grading scale, requests for a
score, text addressed to the grader, "ignore the instructions", an attack on the reference answer, any of these
inside a base64 blob, and hidden tag characters. Most signals are structure and hold in any language; the word
lists (the grader, the instructions, the reference, full marks, asking for a score) cover about a dozen languages
and are the weakest part.

It does no I/O and builds no prompt (`judge_prompts`); what a flagged candidate scores is `judge.py`'s.
"""

from __future__ import annotations

import base64
import binascii
import html
import re
import unicodedata
from dataclasses import dataclass

_MAX_DECODE_ROUNDS = 4
"""Nested encodings (an entity of an escape of an entity) are undone up to this depth; each round only shrinks text."""
_MAX_BASE64_BLOBS = 64

_TAG_CHARS = re.compile("[\U000e0000-\U000e007f]")
_SUPPLEMENTARY_SELECTORS = re.compile("[\U000e0100-\U000e01ef]")
_VARIATION_SELECTORS = re.compile("[\ufe00-\ufe0f\U000e0100-\U000e01ef]")
_BACKSLASH_ESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})|\\U([0-9a-fA-F]{8})|\\x([0-9a-fA-F]{2})")
_PERCENT_RUN = re.compile(r"(?:%[0-9A-Fa-f]{2})+")
_WORD = re.compile(r"[^\W\d_]+")
_LATIN = re.compile(r"[A-Za-z]")
_CYRILLIC_OR_GREEK = re.compile(r"[\u0370-\u03ff\u0400-\u04ff\u0500-\u052f]")
_BASE64_BLOB = re.compile(r"[A-Za-z0-9+/_-]{24,}={0,2}")
_MAX_MASTER_KEY_CHARS = 200
_MASTER_KEY_OPENERS = (
    "solution|answer|final answer|the answer is|my answer|response|result|thought process|thoughts|thinking|"
    "reasoning|analysis|explanation|let's think step by step|let's solve this step by step|"
    "let's solve this problem step by step|let's solve it step by step|step by step|step 1|let me think|"
    "let me solve this|here is the solution|here's the solution|sure|okay|ok|"
    "solución|respuesta|réponse|lösung|antwort|soluzione|risposta|solução|resposta|решение|ответ|"
    "解|解答|答|答案|解析|思路|解説|かいせつ|回答|풀이|답|해설"
)

# Cyrillic and Greek letters that render like Latin ones (the common subset of Unicode's confusables)
_CONFUSABLES = str.maketrans(
    "аеорсухіјѕԁԛԝһӏүвкмнтАВЕКМНОРСТХУІЈЅԚԜ" + "αβεικνορτυχΑΒΕΖΗΙΚΜΝΟΡΤΥΧ" + "ıɑ",
    "aeopcyxijsdqwhlybkmhtABEKMHOPCTXYIJSQW" + "aBeikvoptuxABEZHIKMNOPTYX" + "ia",
)

_LINE_START = r"(?:^|\n|\\n|\\r)[ \t#>*`\"'\-\[(]*"  # no newline in the class: a newline bomb stays linear
_ROLES = (
    "system|assistant|user|developer|human|ai|instructions?|grader|evaluator|judge|syst[eè]me|sistema|"
    "система|ассистент|пользователь|系统|系統|システム|시스템|助手|用户|사용자"
)
_GRADE_KEYS = (
    "scores?|grade|rating|verdict|points|marks?|note|nota|punteggio|puntuaci[oó]n|bewertung|punktzahl|оценка|"
    "балл|баллы|分数|分數|评分|評分|得分|点数|評価|점수"
)
_FULL_MARKS = (
    "full marks|perfect score|maximum score|highest score|top marks|max(?:imum)? (?:marks|points|grade)|"
    "note maximale|note parfaite|volle punktzahl|h[öo]chste punktzahl|puntuaci[oó]n m[aá]xima|nota m[aá]xima|"
    "punteggio massimo|pontua[cç][aã]o m[aá]xima|высш\\w* балл|максимальн\\w* (?:балл|оценк)|наивысш\\w* оценк|"
    "满分|滿分|満点|最高分|最高点|만점|최고 점수"
)
_IGNORE = (
    "ignore|disregard|forget|override|bypass|ignorez|ignorer|oubliez|oublie|ignoriere|ignorieren|vergiss|vergessen|"
    "ignora|ignorar|olvida|olvide|esque[cç]a|игнориру\\w*|забудь\\w*|не обращай\\w*|"
    "忽略|无视|無視|忘记|忘掉|不要理会|무시"
)
_INSTRUCTIONS = (
    "instruction|rule|prompt|guideline|directive|consigne|r[èe]gle|anweisung|regel|vorgabe|instrucci|regla|istruzion|"
    "regol|instru[cç]|инструкц|указани|правил|指令|指示|规则|規則|提示|命令|要求|지시|규칙|명령"
)
_GRADER = (
    "grader|graders|evaluator|examiner|assessor|grading (?:model|system|assistant|ai)|dear (?:ai|model|assistant|llm)|"
    "dear judge|correcteur|correctrice|[ée]valuateur|examinateur|bewerter|pr[üu]fer|korrektor|gutachter|evaluador|"
    "calificador|examinador|valutatore|correttore|esaminatore|avaliador|оценщик|проверяющ\\w*|экзаменатор|"
    "评分员|评分者|评分人|阅卷|考官|评委|評分員|評審|採点者|評価者|채점자|평가자|심사위원|"
    "you are now|from now on,? you|let'?s play a game|role-?play|pretend (?:to be|you are)|tu es maintenant|"
    "du bist jetzt|ahora eres|ты теперь|теперь ты|你现在是|从现在开始你|扮演|假装你|あなたは今から|지금부터 너는"
)
_REFERENCE = (
    "reference (?:answer|solution)|answer key|expected answer|official answer|gold(?:en)? answer|model answer|"
    "marking scheme|r[ée]ponse de r[ée]f[ée]rence|r[ée]ponse attendue|corrig[ée] officiel|musterl[öo]sung|"
    "referenzantwort|respuesta de referencia|respuesta esperada|risposta di riferimento|resposta de refer[êe]ncia|"
    "эталонн\\w*|ключ\\w* ответ|参考答案|标准答案|標準答案|參考答案|模範解答|참고 답안|정답지|모범 답안"
)

_SIGNALS: dict[str, re.Pattern[str]] = {
    "chat_template_token": re.compile(
        r"<\|[^\s<>|]{1,40}\|>|<\|(?:im_start|im_end|endoftext|eot_id|system|user|assistant)|\[/?inst\]|<</?sys>>|"
        r"<(?:start|end)_of_turn>|</s>|<s>|<\|?(?:bos|eos)\|?>"
    ),
    "role_marker": re.compile(
        _LINE_START + rf"(?:{_ROLES})\s*[\])]?\s*:|" + _LINE_START + r"#{2,}\s*(?:instruction|system|response|input)"
    ),
    "prompt_structure": re.compile(
        r"</?(?:data|task|reference|response|candidate|rubric|criteria|instructions?|system|grader|judge|verdict|"
        r"scores?|grade|evaluation)(?:[-_][^\s<>]*)?\s*/?>|\\?[\"']nonce\\?[\"']\s*[:=]|\bnonce\s*[:=]|"
        r"reference[_ ]answer\\?[\"']?\s*[:=]|response_truncated"
    ),
    "verdict_structure": re.compile(
        rf"[{{,]\s*\\?[\"']?(?:{_GRADE_KEYS})\\?[\"']?\s*[:=]|\[\[\s*\d+(?:\.\d+)?\s*\]\]|"
        + _LINE_START
        + r"(?:final\s+)?(?:grade|rating|verdict|evaluation|оценка|评分|分数|得分|評価|점수)\s*[:=]\s*\[{0,2}\d|"
        r"\bscore\s*[:=]\s*\d+(?:\.\d+)?\s*/\s*\d+"
    ),
    "full_marks_claim": re.compile(rf"{_FULL_MARKS}|[打给給]\s*\d+(?:\.\d+)?\s*分|[打给給]\s*满分"),
    "override_instruction": re.compile(
        rf"(?:{_IGNORE}).{{0,60}}?(?:{_INSTRUCTIONS})|(?:{_INSTRUCTIONS}).{{0,20}}?(?:{_IGNORE})|"
        r"new instructions|nouvelles (?:instructions|consignes)|neue anweisungen|nuevas instrucciones|"
        r"новые инструкции|新的指令|新指令",
        re.DOTALL,
    ),
    "score_request": re.compile(
        r"\b(?:give|assign|award|rate|grade|output|mark)\w*\b.{0,40}?\b(?:score|grade|rating|marks?|points?)\b.{0,12}?\d|"
        r"\b(?:donne|attribue|mets|mettez)\w*\b.{0,40}?\b(?:note|score)\b|\b(?:gib|vergib|geben)\b.{0,40}?(?:punkte|note)|"
        r"\b(?:da|dale|asigna|otorga)\b.{0,40}?(?:puntuaci|nota)|\b(?:поставь|дай|выстав)\w*.{0,40}?(?:оценк|балл)|"
        r"[打给給]\s*(?:这个|這個|该|該|此)?\s*(?:回答|答案|回复|回覆)?\s*(?:\d+(?:\.\d+)?\s*分|满分|滿分|高分)",
        re.DOTALL,
    ),
    "grader_address": re.compile(_GRADER),
    "reference_attack": re.compile(_REFERENCE),
}
_SCALE_CLAIM = re.compile(
    r"(?<![\d.])(\d{1,6}(?:\.\d{1,3})?) ?(?:/|out of|sur|von|de|из|su|di|на|üzerinden) ?"
    r"(\d{1,6}(?:\.\d{1,3})?)(?![\d.])"
)


def normalise_candidate(text: str) -> str:
    """The candidate as plain text: escapes decoded, NFKC, invisible characters gone, mixed-script words folded."""
    for _ in range(_MAX_DECODE_ROUNDS):
        decoded = _decode_pass(text)
        if decoded == text:
            break
        text = decoded
    return _WORD.sub(_fold_if_mixed, text)


def find_injection_signals(text: str, *, raw: str = "", context: str = "", max_score: float = 10.0) -> list[str]:
    """The names of the injection structures in ``text`` (a `normalise_candidate` result), sorted; empty when none.

    ``raw`` is the text as the policy wrote it (for hidden characters); ``context`` is the task and reference: a
    phrase they use themselves (a task about scores, a fraction in the question) is not held against the
    candidate. ``max_score`` is the top of the judge's scale, so "10/10" on a 0-10 scale is a claim of full marks.
    """
    context = context.casefold()
    views = {text.casefold(), text.translate(_CONFUSABLES).casefold()}
    signals = {name for name, pattern in _SIGNALS.items() if any(_found(pattern, view, context) for view in views)}
    if any(_claims_full_marks(view, context, max_score) for view in views):
        signals.add("full_marks_claim")
    if _TAG_CHARS.search(raw) or _SUPPLEMENTARY_SELECTORS.search(raw):
        signals.add("hidden_text")
    if any(find_injection_signals(payload, context=context, max_score=max_score) for payload in _base64_payloads(text)):
        signals.add("encoded_payload")
    return sorted(signals)


def is_master_key(text: str, *, reference: str = "") -> bool:
    """True when ``text`` (a `normalise_candidate` result) holds no answer at all: nothing but spaces, punctuation
    and symbols (":", ".", "—"), and reasoning openers ("Solution:", "Thought process:", "Let's solve this step by
    step.", "解：", in about a dozen languages). Weak judge models give such "master keys" full marks (Zhao et al.
    2025, "One Token to Fool LLM-as-a-Judge"). A candidate that is the reference itself (a task whose answer is
    "/") is not one."""
    bare = _bare_words(text)
    if len(bare) > _MAX_MASTER_KEY_CHARS:
        return False
    if reference and text.strip() == reference.strip():
        return False
    return _MASTER_KEY.fullmatch(bare) is not None


@dataclass(kw_only=True, slots=True, frozen=True)
class ScreenedCandidate:
    text: str
    """The normalised candidate: what the judge is shown."""
    signals: tuple[str, ...]
    """`find_injection_signals` of it; empty when it looks like a plain answer."""
    is_master_key: bool = False
    """`is_master_key` of it: no content for a judge to grade."""


def screen_candidate(completion: str, *, context: str, max_score: float, reference: str = "") -> ScreenedCandidate:
    """Normalises ``completion``, looks for injection structures in it and checks that it has content (in that
    order); ``reference`` is the task's reference answer, if any."""
    text = normalise_candidate(completion)
    signals = find_injection_signals(text, raw=completion, context=context, max_score=max_score)
    return ScreenedCandidate(text=text, signals=tuple(signals), is_master_key=is_master_key(text, reference=reference))


def _bare_words(text: str) -> str:
    """``text`` casefolded, with every punctuation mark, symbol, space and control character as one space."""
    kept = (" " if unicodedata.category(char)[0] in "PSZC" else char for char in text.casefold())
    return " ".join("".join(kept).split())


def _decode_pass(text: str) -> str:
    text = _TAG_CHARS.sub(lambda m: chr(ord(m.group()) - 0xE0000) if ord(m.group()) >= 0xE0020 else "", text)
    text = _VARIATION_SELECTORS.sub("", text)
    text = unicodedata.normalize("NFKC", text)
    text = "".join(char for char in text if unicodedata.category(char) != "Cf")
    if "&" in text:
        text = html.unescape(text)
    if "\\" in text:
        text = _BACKSLASH_ESCAPE.sub(_unescape, text)
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")  # join escaped surrogate pairs
    if "%" in text:
        text = _PERCENT_RUN.sub(_unquote, text)
    return text


def _unescape(match: re.Match[str]) -> str:
    code = int(next(group for group in match.groups() if group is not None), 16)
    return chr(code) if code <= 0x10FFFF else match.group()


def _unquote(match: re.Match[str]) -> str:
    try:
        return bytes.fromhex(match.group().replace("%", "")).decode("utf-8")
    except UnicodeDecodeError:
        return match.group()


def _fold_if_mixed(match: re.Match[str]) -> str:
    word = match.group()
    if _LATIN.search(word) and _CYRILLIC_OR_GREEK.search(word):
        return word.translate(_CONFUSABLES)
    return word  # a whole Russian or Greek word is left as it is: it is a real word, not a disguise


def _found(pattern: re.Pattern[str], view: str, context: str) -> bool:
    return any(match.group().strip() not in context for match in pattern.finditer(view))


def _claims_full_marks(view: str, context: str, max_score: float) -> bool:
    tops = {max_score, 10.0, 100.0}
    for match in _SCALE_CLAIM.finditer(view):
        given, top = float(match.group(1)), float(match.group(2))
        if given == top and top in tops and match.group() not in context:
            return True
    return False


def _base64_payloads(text: str) -> list[str]:
    """Readable text hidden in base64 blobs (standard or URL-safe alphabet), normalised."""
    payloads = []
    for blob in _BASE64_BLOB.findall(text)[:_MAX_BASE64_BLOBS]:
        padded = blob.rstrip("=") + "=" * (-len(blob.rstrip("=")) % 4)
        try:
            decoded = base64.b64decode(padded.replace("-", "+").replace("_", "/"), validate=True).decode("utf-8")
        except (binascii.Error, ValueError):
            continue
        if decoded and sum(char.isprintable() or char.isspace() for char in decoded) >= 0.9 * len(decoded):
            payloads.append(normalise_candidate(decoded))
    return payloads


# A whole candidate of openers only ("Solution: Let's think step by step."), compared as bare words.
_MASTER_KEY = re.compile(
    "(?:(?:"
    + "|".join(sorted({re.escape(_bare_words(o)) for o in _MASTER_KEY_OPENERS.split("|")}, key=len, reverse=True))
    + r") ?)*"
)

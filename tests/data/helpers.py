"""Shared helpers for the data tests: run a tool's main() in-process, a varied Unicode text set."""

import importlib.util
import json
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIED_TEXTS = [
    "Hello world! It's a test: we'll see, they've done, I'm here, you'd go, she's 'quoted'.",
    "Café naïve résumé coöperate Ångström façade jalapeño — déjà vu «guillemets» ¿qué?",
    "日本語のテキスト、中文字符和한국어 텍스트。 Mixed 混合 scripts ελληνικά русский текст עברית العربية",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ and symbols ∑∫√∞ ≠ ≤ ≥ € £ ¥ © ®",
    "Control chars: \x00\x01\x07\x1b[0m\x1c\x1d\x1e\x1f\x7f\x85 tab\there\r\nCRLF\u2028LS\u2029PS\ufeffBOM",
    "Runs    of     spaces\n\n\n\nand newlines\n \n  \n\t\t\ttabs   \t  mixed  ",
    "   leading and trailing spaces   ",
    "Numbers 1234567890 3.14159 1e-10 0x1F ١٢٣ ½ ² 𝟙𝟚 and 10,000,000 12:30pm",
    "def f(x):\n    return x ** 2  # comment\n\nclass A:\n    pass\n",
    "contractions: don't can't won't isn't 'twas y'all O'Neil's 'S 'T 'Ll",
    "Zero\u200bwidth\u200djoiner and combining e\u0301 a\u0308 n\u0303, NBSP\u00a0here",
    "\u3000ideographic space\u3000and\u2003em space and \u00a0\u00a0double nbsp",
    "URLs https://example.com/path?q=1&b=2#frag and emails a.b@c.org",
    "",
    " ",
    "\n",
    "a",
    "The quick brown fox jumps over the lazy dog. " * 5,
    "Ⅻ ⅷ ℃ ℉ ﬁ ﬂ ＡＢＣ ｱｲｳ ＿ ～",
    "Surrogate-free astral: 𐍈 𝄞 🀄 and private use \ue000\uf8ff",
]


def load_tool(name: str):
    """Import tools/<name>.py as a module (tools are scripts, run here through their main())."""
    path = os.path.join(REPO_ROOT, "tools", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"tool_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_jsonl(path, texts, key="text") -> str:
    """One {key: text} object per line."""
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({key: text}, ensure_ascii=False) + "\n")
    return str(path)


def run_preprocess(tok_files: tuple[str, str], inp: str, prefix: str, *extra: str) -> str:
    """tools/preprocess_data.py with the GPT-2 BPE of `tok_files`; returns the output's data prefix."""
    load_tool("preprocess_data").main(
        [
            "--input",
            inp,
            "--output-prefix",
            prefix,
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            tok_files[0],
            "--merge-file",
            tok_files[1],
            *extra,
        ]
    )
    return prefix + "_text_document"

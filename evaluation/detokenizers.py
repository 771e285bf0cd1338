"""WikiText's detokenizer: Megatron-LM's (tasks/zeroshot_gpt/detokenizer.py, `wikitext_detokenizer`) and
lm-evaluation-harness's (lm_eval/tasks/wikitext/preprocess_wikitext.py) are the same function, line for line;
this is that function. Megatron applies it to the whole file, the harness to each article: the convention
decides the input, not the rules (evaluation/tasks.py).

It undoes WikiText's tokenization before BPE sees the text: `@-@` / `@,@` / `@.@` number separators, spaces
before punctuation, spaces inside brackets and quotes, `= = =` headings. tests/evaluation compares it with the
harness's own copy.
"""

from __future__ import annotations

import re


def wikitext_detokenizer(string: str) -> str:
    """The detokenized text of WikiText (wiki.test.tokens) `string`."""
    # contractions
    string = string.replace("s '", "s'")
    string = re.sub(r"/' [0-9]/", r"/'[0-9]/", string)
    # number separators
    string = string.replace(" @-@ ", "-")
    string = string.replace(" @,@ ", ",")
    string = string.replace(" @.@ ", ".")
    # punctuation
    string = string.replace(" : ", ": ")
    string = string.replace(" ; ", "; ")
    string = string.replace(" . ", ". ")
    string = string.replace(" ! ", "! ")
    string = string.replace(" ? ", "? ")
    string = string.replace(" , ", ", ")
    # double brackets
    string = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", string)
    string = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", string)
    string = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", string)
    string = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', string)
    string = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", string)
    # miscellaneous
    string = string.replace("= = = =", "====")
    string = string.replace("= = =", "===")
    string = string.replace("= =", "==")
    string = string.replace(" " + chr(176) + " ", chr(176))
    string = string.replace(" \n", "\n")
    string = string.replace("\n ", "\n")
    string = string.replace(" N ", " 1 ")
    string = string.replace(" 's", "'s")
    return string

"""What a sequence may not sample next: stop tokens and end-of-sequence before min_tokens,
the end-of-sequence a grammar is not yet done without, and bad words' last tokens.

Pure functions of a sequence and its request's rules: the output processor calls them
for every sampling sequence of a step, and the worker turns the lists into masks.
"""

from __future__ import annotations

from tokenmill.engine.core.step import Sequence


def banned_token_ids(seq: Sequence, eos_token_ids: set[int]) -> list[int]:
    """Tokens seq may not sample next: stop tokens and EOS before min_tokens.

    A constrained sequence's EOS is banned while its grammar can continue, before
    min_tokens and under ignore_eos alike; once the grammar is complete EOS is all it
    allows, so nothing is banned - min_tokens and ignore_eos never outlast a grammar.
    """
    p = seq.params
    grammar = seq.grammar
    if grammar is not None and grammar.is_complete:
        return []
    if seq.num_completion_tokens < p.min_tokens:
        bans_eos = grammar is not None or not p.ignore_eos
        return sorted(set(p.stop_token_ids) | (eos_token_ids if bans_eos else set()))
    if grammar is not None and p.ignore_eos:
        return sorted(eos_token_ids)
    return []


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token sequences, as vLLM forms them: the word as written (leading
    spaces stripped) and, where it tokenizes to a different first token of the same
    count, with one leading space - a word at the start of the text and in its middle."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if bare:
            out.append(bare)
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def bad_word_bans(seq: Sequence, words: list[list[int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """Bad words' last tokens seq may not sample next: a one-token word always; a longer
    one when the output ends with the word's other tokens. While the output's last token
    is pending, a word whose earlier tokens match up to it is banned on condition that
    the pending token is the one it needs."""
    output_len = seq.num_completion_tokens
    pending = seq.num_pending_tokens > 0
    banned: list[int] = []
    conditional: list[tuple[int, int]] = []
    for word in words:
        *prefix, last = word
        if not prefix:
            banned.append(last)
            continue
        if len(prefix) > output_len:
            continue
        tail = seq.token_ids[len(seq.token_ids) - len(prefix) :]
        if not pending:
            if tail == prefix:
                banned.append(last)
        elif tail[:-1] == prefix[:-1]:
            conditional.append((last, prefix[-1]))
    return banned, conditional

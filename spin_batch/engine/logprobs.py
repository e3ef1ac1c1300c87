"""Token log-probabilities: of each generated token, and of each prompt token, from the target's logits.

A generated token's numbers come from the target row that produced it: under speculation the verify
row at which it was accepted (or recovered, or the bonus), which holds the logits plain decoding
computes at that position. A prompt token's come from the prefill row before it; the first prompt
token has none. Two distributions, named as vLLM's ``logprobs_mode``:

- ``raw_logprobs`` (the default, vLLM's too): log_softmax of the raw logits;
- ``processed_logprobs``: the distribution a sampled token was drawn from, after temperature, top-k
  and top-p (a filtered token has -inf); a greedy request's is the raw one, as in vLLM.

Only the rows of requests that ask are scored, only at the positions whose tokens are kept, and only
their K most likely tokens are taken (torch.topk), never a sort of the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from ..records import TokenLogprob
from ..sampling import SamplingParams, probs_from_logits
from .verify import Verdict

_BLOCK = 256  # rows scored at once: a long prompt chunk's [rows, V] log-probs stay bounded


@dataclass(frozen=True)
class LogprobAsk:
    """What one request asks for: top-K of each generated token and of each prompt token (None: not at
    all; 0: the token's own log-probability only), and whether from the processed distribution."""

    logprobs: int | None = None
    prompt_logprobs: int | None = None
    processed: bool = False

    def of_row(self, logprobs: int | None, prompt_logprobs: int | None, max_tokens: int) -> LogprobAsk:
        """A request's ask: this (the job's) overridden by the row's own; a scoring request (max_tokens 0)
        scores its prompt tokens at least."""
        prompt = next((k for k in (prompt_logprobs, self.prompt_logprobs) if k is not None),
                      0 if max_tokens == 0 else None)
        return LogprobAsk(self.logprobs if logprobs is None else logprobs, prompt, self.processed)


NO_LOGPROBS = LogprobAsk()


@dataclass(frozen=True)
class Scored:
    """A token's log-probability at one position, its rank there, and the top tokens (most likely first)."""

    token: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


def log_probs(logits: torch.Tensor, sps: list[SamplingParams | None] | None) -> torch.Tensor:
    """[M, V] logits -> [M, V] float32 log-probabilities: raw, or processed under sps[i] where it is a
    sampled request's settings (None or a greedy request's: raw)."""
    raw = torch.log_softmax(logits.float(), -1)
    if sps is None or all(sp is None or sp.greedy for sp in sps):
        return raw
    groups: dict[SamplingParams, list[int]] = {}
    for i, sp in enumerate(sps):
        if sp is not None and not sp.greedy:
            groups.setdefault(sp, []).append(i)
    for sp, rows in groups.items():
        index = torch.tensor(rows, device=logits.device)
        raw[index] = probs_from_logits(logits[index], sp).log()
    return raw


def score(
    logits: torch.Tensor,  # [M, V] the rows to score
    tokens: list[int],  # [M] the token taken at each row
    ks: list[int],  # [M] top tokens wanted per row
    sps: list[SamplingParams | None] | None = None,  # [M] processed under these settings (log_probs); None: raw
) -> list[Scored]:
    """Each row's token log-probability, its rank, and the row's top ks[i] tokens."""
    out: list[Scored] = []
    for a in range(0, len(tokens), _BLOCK):
        b = min(a + _BLOCK, len(tokens))
        lp = log_probs(logits[a:b], None if sps is None else sps[a:b])  # [m, V]
        tok = torch.tensor(tokens[a:b], dtype=torch.long, device=lp.device)
        chosen = lp.gather(1, tok[:, None])  # [m, 1]
        rank = (lp > chosen).sum(-1) + 1  # [m]
        k = max(ks[a:b])
        top_v, top_i = torch.topk(lp, k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())  # [m, k]
        rows = zip(tokens[a:b], chosen[:, 0].tolist(), rank.tolist(), top_i.tolist(), top_v.tolist(), ks[a:b])
        out.extend(Scored(t, c, r, tuple(ids[:n]), tuple(vs[:n])) for t, c, r, ids, vs, n in rows)
    return out


def score_new_tokens(
    logits: torch.Tensor,  # [R, V] the step's verify rows (decoding segments, then finishing prefills)
    asks: list[LogprobAsk],  # [S] per served segment
    sps: list[SamplingParams],  # [S]
    drafts: list[list[int]],  # [len(decode)] the decoding segments' drafts (a tree: its nodes)
    verdict: Verdict,  # [S]
) -> list[list[Scored]] | None:
    """The new tokens' numbers of the segments whose request asks (an empty list for the others);
    None when none asks. All asking rows are scored in one batch."""
    want = [i for i, a in enumerate(asks) if a.logprobs is not None]
    if not want:
        return None
    rows = new_token_rows(drafts, verdict.paths, verdict.accepted, len(asks) - len(drafts))
    index = [r for i in want for r in rows[i]]
    tokens = [t for i in want for t in verdict.tokens[i]]
    ks = [asks[i].logprobs for i in want for _ in rows[i]]
    modes = [sps[i] if asks[i].processed else None for i in want for _ in rows[i]]
    got = score(logits[torch.tensor(index, device=logits.device)], tokens, ks, modes)
    out: list[list[Scored]] = [[] for _ in asks]
    at = 0
    for i in want:
        out[i], at = got[at : at + len(rows[i])], at + len(rows[i])
    return out


def new_token_rows(drafts: list[list[int]], paths: list[list[int] | None] | None, accepted: list[int],
                   finishing: int) -> list[list[int]]:
    """Per served segment (the decoding slots', then one per finishing prefill), the logits row that
    produced each of its new tokens (accepted + 1).

    A decoding slot's rows are its segment's, end to end (1 + len(draft) each): its k-th new token
    comes from the row of the (k-1)-th accepted draft token, the first from the segment's first row.
    A tree's accepted nodes are the verdict's path (segment token indices); a chain's are 1..accepted.
    A finishing prefill's one token comes from its one row, after the decoding rows.
    """
    starts = [0, *accumulate(len(d) + 1 for d in drafts)]
    paths = paths if paths is not None else [None for _ in drafts]
    rows = [[a + r for r in [0, *(range(1, k + 1) if p is None else p)]]
            for a, k, p in zip(starts[:-1], accepted, paths)]  # the verdict's entries past drafts: finishing
    return rows + [[starts[-1] + j] for j in range(finishing)]


def score_prompts(prompt: list[tuple], logits: torch.Tensor) -> torch.Tensor:
    """Record the prompt logprobs of a plan's scored chunks, (slot, first position, rows) each, whose
    rows close the logits (raw; each row scores the next prompt token); returns the other rows."""
    main = logits.shape[0] - sum(m for *_, m in prompt)
    got = score(logits[main:], [t for s, p, m in prompt for t in s.tokens[p + 1 : p + 1 + m]],
                [s.ask.prompt_logprobs for s, _, m in prompt for _ in range(m)])
    for s, _, m in prompt:
        s.prompt_logprobs.extend(got[:m])
        got = got[m:]
    return logits[:main]


def prompt_rows(prompt_len: int, position: int, n: int) -> int:
    """How many rows of a prefill chunk (n tokens from `position`) score a prompt token (the next one):
    every one but the prompt's last, whose logits give the first generated token."""
    return max(min(n, prompt_len - 1 - position), 0)


class TokenTexts:
    """Each token id decoded alone (special tokens shown), remembered: a job meets few distinct ids."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.seen: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self.seen.get(token)
        if text is None:
            text = self.seen[token] = self.tok.decode([token])
        return text

    def record(self, s: Scored | None) -> TokenLogprob | None:
        if s is None:
            return None
        return TokenLogprob(s.token, self(s.token), s.logprob, s.rank, s.top_ids, tuple(map(self, s.top_ids)),
                            s.top_logprobs)

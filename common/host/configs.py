"""From a caller's keyword options to a variant's compile-time configuration, the same way for every
variant: unknown options and head dims are refused by name, `None` means "the default", defaults
come per head_dim (refined per (head_dim, causal) where a measurement asked for it), and each
distinct configuration is built and validated once (it keys the kernel caches). `recorded` hands
a caller the configurations its calls resolved (what experiments/run.py logs as a job's)."""
import threading
from contextlib import contextmanager
from dataclasses import fields, replace
from functools import lru_cache, wraps

from common.hardware import elements
from common.tile import tiles

# What every Config starts with, and what a variant's Config may add after them (fa3: its FP8
# inputs; softcap): set from the problem, never options. `causal` is the band mask of
# common/tile/masks.py (causal or a sliding window): its bounds are kernel arguments.
PROBLEM_FIELDS = ("head_dim", "element", "causal", "fp8", "k_block_scales", "softcap", "window",
                  "varlen", "bottom_right", "alibi", "sinks", "dropout", "mods", "block_mask",
                  "paged")


def once_per_config(method):
    """A Config method without arguments (a shared-memory layout, say) computed once per
    configuration and kept in the instance's __dict__, beside (not among) its dataclass fields:
    configurations are immutable and made once each (default_config's cache), and the launch path
    asks for the same layout every call (~3-11 us a call to rebuild)."""
    name = "_once_" + method.__name__

    @wraps(method)
    def once(self):
        memo = self.__dict__
        if name not in memo:
            memo[name] = method(self)
        return memo[name]

    return once


def options_of(config_class):
    """A variant's option names: its Config's fields after the problem's (one declaration)."""
    return tuple(f.name for f in fields(config_class) if f.name not in PROBLEM_FIELDS)


def default_config_function(variant, config_class, defaults, option_names, head_dims):
    """`default_config(head_dim, element, causal, **options)` for one variant: its Config with
    defaults[head_dim], then defaults[(head_dim, causal)] where present, overridden by the options
    that are not None, validated."""

    @lru_cache(maxsize=None)
    def build(head_dim, element, causal, chosen, problem):
        base = config_class(head_dim, element, causal, **dict(problem))
        keys = [head_dim, (head_dim, causal)] + [(head_dim, k) for k, v in problem if v is True]
        fields = {}
        for key in keys:
            fields.update(defaults.get(key, {}))
        return replace(base, **dict(fields, **dict(chosen))).validate()

    def default_config(head_dim, element, causal, problem=(), **options):
        """The configuration `forward` launches: DEFAULTS for the head_dim, overridden by options.
        problem: ((field, value), ...) of the Config's further problem fields (fa3: fp8); a true
        one may have defaults of its own, DEFAULTS[(head_dim, field)]. element: an
        elements.Element or its name."""
        element = elements.element(element)
        if not options and head_dim in head_dims:   # the common call: no options, no checks
            return _record(build(head_dim, element, causal, (), tuple(problem)))
        unknown = set(options) - set(option_names)
        if unknown:
            raise ValueError(f"{variant} has no option {', '.join(sorted(unknown))}; its options: "
                             f"{', '.join(option_names)}")
        tiles.check_head_dim(head_dim, variant, head_dims)
        chosen = {k: v for k, v in options.items() if v is not None}
        return _record(build(head_dim, element, causal, tuple(sorted(chosen.items())),
                             tuple(problem)))

    return default_config


_recording = threading.local()   # .open: the lists of this thread's open `recorded` blocks


@contextmanager
def recorded():
    """The configurations the default_config functions (default_config_function) return inside
    the block, on this thread: a list, each configuration once, in the order first returned. A
    variant's call launches the Config its default_config returned, so this is what the calls
    in the block ran (experiments/run.py logs a job's forward from it rather than resolving it a
    second time). A call that resolves none adds none: a replayed one (common/host/replay.py), and
    one through a cache above default_config after its first (fa1's backward)."""
    seen = []
    blocks = _recording.__dict__.setdefault("open", [])
    blocks.append(seen)
    try:
        yield seen
    finally:
        blocks.pop()


def _record(config):
    for seen in getattr(_recording, "open", ()):
        if config not in seen:
            seen.append(config)
    return config


def mask_fields(prob, backward=False):
    """The `problem` argument of default_config for a call's mask beyond `causal`: ("window",
    True) when the band has a left edge, ("softcap", True) when the scores are capped, ("alibi",
    True) and ("sinks", True) for those score terms (problem.with_score_terms; a backward's
    kernels read the sinks only through L: `backward` leaves them out, so that they run the
    kernels of the call without), ("dropout", True) with dropout on P (fa2: problem.with_dropout),
    and a packed batch's fields; () for none (so the
    configurations without them keep their keys)."""
    fields = tuple((f, True) for f, on in (("window", prob.band.windowed),
                                           ("softcap", prob.softcapped),
                                           ("alibi", getattr(prob, "alibi", None) is not None),
                                           ("sinks", not backward and
                                            getattr(prob, "sinks", None) is not None),
                                           ("dropout", bool(getattr(prob, "dropout_p", 0))))
                   if on)
    if getattr(prob, "mods", None) is not None:   # score_mod / mask_mod (common/host/mods.py)
        fields += (("mods", prob.mods),)
    bm = getattr(prob, "block_mask", None)
    if bm is not None and (not backward or bm.heads == 1 or prob.kv_group == 1):
        # fa2 visits its lists only (a backward's K/V kernel walks a group of query heads with
        # one list: a mask by head under GQA leaves the backward visiting the band)
        fields += (("block_mask", True),)
    if prob.varlen is not None:   # a packed batch (prepare_varlen): where its diagonal sits
        fields += (("varlen", True), ("bottom_right", prob.varlen.bottom_right))
    if getattr(prob, "pages", None) is not None:   # its keys in a paged cache (fa2's forward)
        fields += (("paged", True),)
    return fields


def resolved_defaults(default_config, head_dims, flags=()):
    """{(head_dim, causal, flag): Config} of every problem `default_config` resolves by itself (no
    options): each head dim, causal or not, and for each problem field in `flags` (those with
    defaults of their own, DEFAULTS[(head_dim, field)]: fa3's "fp8") that field set (flag None:
    none set). Problems the variant refuses (fa3's FP8 at d=64) are left out. The element type
    does not choose defaults: bfloat16 stands for every one."""
    configs = {}
    for head_dim in head_dims:
        for causal in (False, True):
            for flag in (None,) + tuple(flags):
                try:
                    configs[head_dim, causal, flag] = default_config(
                        head_dim, "bfloat16", causal, () if flag is None else ((flag, True),))
                except ValueError:
                    continue
    return configs


def default_flags(defaults):
    """The problem fields that have defaults of their own in a DEFAULTS dict: the field names of
    its (head_dim, field) keys (fa3: "fp8")."""
    return tuple(sorted({k[1] for k in defaults if isinstance(k, tuple) and isinstance(k[1], str)}))


def describe_default(option, configs, head_dims):
    """One option's default over `configs` (resolved_defaults) in a line, as `python
    experiments/run.py dry_run=true` prints it beside the job's value (the variant files leave every
    option null and state no default): "128", or the exceptions and then the rest, "1 at d=128
    non-causal; else 2"."""
    values = {key: show_value(getattr(cfg, option)) for key, cfg in configs.items()}
    counts = {}
    for v in values.values():
        counts[v] = counts.get(v, 0) + 1
    common = max(counts, key=lambda v: (counts[v], -list(counts).index(v)))
    if len(counts) == 1:
        return common
    parts = [f"{v} at {_where([k for k in values if values[k] == v], configs, head_dims)}"
             for v in counts if v != common]
    return "; ".join(parts) + f"; else {common}"


def show_value(value):
    """A value as YAML writes it (true, false, null, 128, atomic)."""
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def _where(keys, configs, head_dims):
    """The problems `keys` (of configs' keys) in words: head dims (runs of three or more as
    a..b), each with causal / non-causal where only one of the two is among them, and the flag."""
    groups = {}   # (flag, qualifier) -> head dims
    for head_dim in head_dims:
        for flag in dict.fromkeys(f for _, _, f in configs):
            inside = {c for c in (False, True) if (head_dim, c, flag) in keys}
            possible = {c for c in (False, True) if (head_dim, c, flag) in configs}
            if not inside:
                continue
            qualifier = "" if inside == possible else " causal" if True in inside else " non-causal"
            groups.setdefault((flag, qualifier), []).append(head_dim)
    return ", ".join(f"d={_runs(dims, head_dims)}{q}{'' if flag is None else ' ' + flag}"
                     for (flag, q), dims in groups.items())


def _runs(dims, head_dims):
    """Head dims as runs of consecutive entries of head_dims: '32, 48, 80..112'."""
    index = [head_dims.index(d) for d in dims]
    runs, start = [], 0
    for n in range(1, len(dims) + 1):
        if n == len(dims) or index[n] != index[n - 1] + 1:
            run = dims[start:n]
            runs.append(f"{run[0]}..{run[-1]}" if len(run) >= 3 else ", ".join(map(str, run)))
            start = n
    return ", ".join(runs)

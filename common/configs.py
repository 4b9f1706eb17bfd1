"""From a caller's keyword options to a variant's compile-time configuration, the same way for every
variant: unknown options and head dims are refused by name, `None` means "the default", defaults
come per head_dim (refined per (head_dim, causal) where a measurement asked for it), and each
distinct configuration is built and validated once (it keys the kernel caches)."""
from dataclasses import fields, replace
from functools import lru_cache

from common import elements, tiles

# What every Config starts with, and what a variant's Config may add after them (fa3: its FP8
# inputs; softcap): set from the problem, never options. `causal` is the band mask of
# common/masks.py (causal or a sliding window): its bounds are kernel arguments.
PROBLEM_FIELDS = ("head_dim", "element", "causal", "fp8", "k_block_scales", "softcap", "window",
                  "varlen", "bottom_right")


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
            return build(head_dim, element, causal, (), tuple(problem))
        unknown = set(options) - set(option_names)
        if unknown:
            raise ValueError(f"{variant} has no option {', '.join(sorted(unknown))}; its options: "
                             f"{', '.join(option_names)}")
        tiles.check_head_dim(head_dim, variant, head_dims)
        chosen = {k: v for k, v in options.items() if v is not None}
        return build(head_dim, element, causal, tuple(sorted(chosen.items())), tuple(problem))

    return default_config


def mask_fields(prob):
    """The `problem` argument of default_config for a call's mask beyond `causal`: ("window",
    True) when the band has a left edge, ("softcap", True) when the scores are capped, and a
    packed batch's fields; () for none (so the configurations without them keep their keys)."""
    fields = tuple((f, True) for f, on in (("window", prob.band.windowed),
                                           ("softcap", prob.softcapped)) if on)
    if prob.varlen is not None:   # a packed batch (prepare_varlen): where its diagonal sits
        fields += (("varlen", True), ("bottom_right", prob.varlen.bottom_right))
    return fields

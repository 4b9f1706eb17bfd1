"""Paged K/V caches (vLLM's PagedAttention layout, flash_attn's `block_table`): sequence b's key t
lies at slot t mod page_size of page block_table[b, t / page_size], pages of a power of two keys
(page_shift = log2 page_size). The decode kernel (variants/decoding.py) and fa2's paged prefill
(variants/fa2.py) look their pages up here. Unchecked calls (check=False; a bad table) get wrong
numbers, never an access outside the table or the cache: both indices are clamped."""
from numba import int32

from common.hardware.target import device_function


@device_function
def table_entry(block_table, b, key, page_shift):
    """Sequence b's block-table entry for key `key`, unchecked (the index clamped into the row:
    a key past the table reads its last entry; a table of no columns, whose lengths can only be
    0, reads nothing and gives page 0)."""
    last = int32(block_table.shape[1] - 1)
    if last < 0:
        return int32(0)
    return block_table[b, min(int32(key >> page_shift), last)]


@device_function
def clamp_page(entry, last_page):
    """A table entry clamped into the cache: with check=False a bad table gives wrong numbers,
    never an access outside the cache."""
    return min(max(entry, int32(0)), last_page)


@device_function
def checked_page(block_table, b, key, page_shift, last_page):
    """The page holding key `key` of sequence b: its table entry clamped into range."""
    return clamp_page(table_entry(block_table, b, key, page_shift), last_page)

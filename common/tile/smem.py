"""A thread block's dynamic shared memory, declared once.

A kernel's shared memory is one buffer of named regions laid end to end (`SharedLayout`): its
Config describes them, and both the launch's byte count (`SharedLayout.bytes`) and the kernel's
compile-time offsets (`SharedLayout.start`, in elements of whatever width the kernel views that
part of the buffer as) follow from that one description, so the two cannot drift apart.

    layout = SharedLayout(("q", 128 * 64, 2), ("kv", 2 * 64 * 64, 2), ("stats", 4 * 128, 4))
    layout.bytes             # what the launch asks for
    layout.start("kv")       # 8192: the region's first 16-bit element
    layout.start("stats")    # 8192: its first float (a region's own width, unless given)

Every region starts 16-byte aligned (cp.async, ldmatrix and bulk copies move 16-byte units); an
empty region (count 0: a part the configuration leaves out) takes no room.
"""
from dataclasses import dataclass

ALIGN = 16


@dataclass(frozen=True)
class Region:
    name: str
    count: int        # elements
    itemsize: int     # bytes an element
    offset: int       # bytes from the buffer's start

    @property
    def bytes(self):
        return self.count * self.itemsize


class SharedLayout:
    """Named regions (name, count, itemsize) in order, each at the next 16-byte boundary."""

    def __init__(self, *regions):
        self.regions, at = {}, 0
        for name, count, itemsize in regions:
            if name in self.regions:
                raise ValueError(f"shared-memory region {name!r} declared twice")
            at = (at + ALIGN - 1) // ALIGN * ALIGN
            self.regions[name] = Region(name, int(count), int(itemsize), at)
            at += int(count) * int(itemsize)
        self.bytes = at

    def start(self, name, itemsize=None):
        """The region's first element, counted in elements of `itemsize` bytes (its own)."""
        region = self.regions[name]
        return region.offset // (itemsize or region.itemsize)

    def end(self, name, itemsize=None):
        """One past the region's last element, in elements of `itemsize` bytes (its own)."""
        region = self.regions[name]
        return (region.offset + region.bytes) // (itemsize or region.itemsize)

    def __repr__(self):
        parts = ", ".join(f"{r.name} @{r.offset}+{r.bytes}" for r in self.regions.values())
        return f"SharedLayout({parts}; {self.bytes} bytes)"

"""What Linux says of this process's mappings (/proc/self/smaps), for tests of where memory lives."""

from __future__ import annotations

from pathlib import Path


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping that holds `address` (`hg`: advised for huge pages)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise LookupError(f"no mapping holds {address:#x}")

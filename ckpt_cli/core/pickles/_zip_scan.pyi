# Types of the C extension built from _zip_scan.c (optional: zipio.py parses archives in Python without it).
from typing_extensions import Buffer

def records(archive: Buffer, /) -> list[tuple[str, int, int, int]] | None: ...

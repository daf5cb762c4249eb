"""A bounded table of prepared launches keyed by ints: what the plain launchers of ``cpu.py`` and
``cuda.py`` build once per configuration and reuse on every later call."""
LIMIT = 4096


def memo(table, key, make, *args):
    """``table[key]``, made by ``make(*args)`` on first use; the table is emptied when it holds LIMIT."""
    p = table.get(key)
    if p is None:
        if len(table) >= LIMIT:
            table.clear()
        p = table[key] = make(*args)
    return p

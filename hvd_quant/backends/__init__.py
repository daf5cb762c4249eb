"""Per-framework array adapters (see ``hvd_quant/_arrays.py``). Each module exposes ``adapter(obj)``
and imports its framework itself, so nothing here is imported until an object of that kind shows up."""

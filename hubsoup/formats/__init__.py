"""Other tools' merge descriptions, read and written: :mod:`hubsoup.formats.mergekit` (mergekit YAML configs)."""

"""YAML as configs are read: PyYAML's safe loader without aliases and without duplicate keys.

Why not plain `yaml.safe_load`: an alias (`*a`) is a reference, so a few lines of nested aliases
(the "billion laughs") load as a small graph that expands to gigabytes the moment the config is
copied or written out (the run's config snapshot grew about 10 MB/s until memory ran out); and a key
given twice silently keeps only the last block (a second `rollout:` section drops the first). A
config needs neither: both are refused, naming the line. Anchors alone do nothing and are allowed;
merge keys (`<<: *a`) use an alias and are refused with it.
"""

from __future__ import annotations

from typing import Any

import yaml


class StrictYAMLError(yaml.YAMLError):
    """An alias or a duplicate key in a config's YAML (the message names the line)."""


class _StrictLoader(yaml.SafeLoader):
    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise StrictYAMLError(f"line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not "
                                  "allowed in a config; write the value out")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in first:
                        raise StrictYAMLError(f"line {line}: duplicate key {key!r} (first at line {first[key]}); "
                                              "YAML would keep only the last one")
                    first[key] = line
                except TypeError:  # an unhashable key: the constructor below says so
                    pass
        return super().construct_mapping(node, deep)


def load_strict(text: str) -> Any:
    """The YAML document in `text` (raises StrictYAMLError, or yaml.YAMLError for invalid YAML)."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)

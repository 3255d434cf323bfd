"""Box profiles: named shapes (GPUs, CPU, memory, image, node selector, tolerations) that
`devbox up --profile NAME` and the warm pools use. Pure: parsing, validation and
resolution only; the config file and the cluster's ConfigMap are read elsewhere.

Where profiles come from, weakest first:

1. the built-in "default" (no GPUs, 1 CPU, 2Gi, the config's image);
2. the ConfigMap `devbox-profiles` (key `profiles.toml`) a lab administrator sets for
   everyone in a namespace;
3. the user's own `[profiles.NAME]` tables in config.toml.

A later source replaces a profile of the same name whole (its fields are not merged):
the user's config is what the person running the command asked for, and a profile is a
convenience, not a limit (what a namespace may use is the cluster's to enforce, with
ResourceQuota, LimitRange and admission policies), so overriding one grants nothing
kubectl would not. Replacing whole keeps a profile exactly what one file says, so a later
change to another file's copy never alters it unseen. Warm pools are made from the
cluster's profiles: a claim with a user's own variant matches no warm pod (each warm pod
carries its shape) and starts cold.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from devbox.boxes import BoxSpec, Toleration
from devbox.errors import UsageError

DEFAULT = "default"
BUILT_IN = "built in"
OPERATORS = ("Equal", "Exists")
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_FIELDS = ("gpus", "cpu", "memory", "image", "node_selector", "tolerations")
_TOLERATION_FIELDS = ("key", "operator", "value", "effect", "toleration_seconds")

# A profile's name goes into pod labels and warm pods' names: a DNS-1123 label.
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")
_NUMBER = r"(\d+(\.\d*)?|\.\d+)"
_CPU = re.compile(rf"^{_NUMBER}m?$")
_MEMORY = re.compile(rf"^{_NUMBER}(k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


@dataclass(frozen=True, kw_only=True)
class Profile:
    name: str
    gpus: int = 0
    cpu: str = "1"
    memory: str = "2Gi"
    image: str = ""  # empty: the config's image
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Toleration, ...] = ()
    source: str = BUILT_IN  # "built in", "config file PATH", "ConfigMap NS/devbox-profiles"

    def spec(self, *, gpus: int | None = None) -> BoxSpec:
        """The box this profile makes; `gpus` (an explicit --gpus) replaces the profile's."""
        return BoxSpec(
            gpus=self.gpus if gpus is None else gpus,
            profile=self.name,
            image=self.image,
            cpu=self.cpu,
            memory=self.memory,
            node_selector=self.node_selector,
            tolerations=self.tolerations,
        )

    def to_json(self) -> dict[str, Any]:
        return {**self.spec().to_json(), "name": self.name, "source": self.source}


BUILT_IN_DEFAULT = Profile(name=DEFAULT)


def resolve(*layers: Iterable[Profile]) -> dict[str, Profile]:
    """Name -> profile: the built-in default, then each layer replacing by name (pass the
    cluster's, then the user's)."""
    out = {DEFAULT: BUILT_IN_DEFAULT}
    for layer in layers:
        for profile in layer:
            out[profile.name] = profile
    return out


def choose(catalog: Mapping[str, Profile], name: str) -> Profile:
    found = catalog.get(name)
    if found is None:
        known = ", ".join(sorted(catalog))
        raise UsageError(f"unknown profile {name!r}: the known profiles are {known}")
    return found


def check_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise UsageError(
            f"{what} must be lowercase letters, digits and '-' (at most 63), not {name!r}"
        )
    return name


def parse_document(text: str, *, source: str) -> tuple[Profile, ...]:
    """A ConfigMap's profiles.toml: `[profiles.NAME]` tables, as in config.toml, and
    nothing else. `source` names it in every error."""
    import tomllib  # only when there is a document: see devbox.config.load

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{source} is not valid TOML: {exc}") from None
    for key in data:
        if key != "profiles":
            raise UsageError(f"{source}: unknown setting {key!r} (only [profiles.NAME] tables)")
    return parse_table(data.get("profiles", {}), source=source)


def parse_table(raw: object, *, source: str) -> tuple[Profile, ...]:
    """The value of a document's `profiles` key: one table per profile."""
    if not isinstance(raw, dict):
        raise UsageError(f"{source}: profiles must be tables ([profiles.NAME])")
    out = []
    for name, body in raw.items():
        try:
            check_name(name, "a profile name")
            out.append(_profile(name, body, where=f"profiles.{name}", source=source))
        except UsageError as exc:
            raise UsageError(f"{source}: {exc.message}") from None
    return tuple(out)


def _profile(name: str, body: object, *, where: str, source: str) -> Profile:
    if not isinstance(body, dict):
        raise UsageError(f"{where} must be a table")
    for key in body:
        if key not in _FIELDS:
            raise UsageError(f"{where}: unknown field {key!r} (known: {', '.join(_FIELDS)})")
    values: dict[str, Any] = {}
    if "gpus" in body:
        gpus = body["gpus"]
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
            raise UsageError(f"{where}.gpus must be a whole number, at least 0, not {gpus!r}")
        values["gpus"] = gpus
    if "cpu" in body:
        values["cpu"] = _cpu(body["cpu"], f"{where}.cpu")
    if "memory" in body:
        values["memory"] = _memory(body["memory"], f"{where}.memory")
    if "image" in body:
        image = body["image"]
        if not isinstance(image, str) or not image or any(c.isspace() for c in image):
            raise UsageError(f"{where}.image must be an image reference, not {image!r}")
        values["image"] = image
    if "node_selector" in body:
        values["node_selector"] = _selector(body["node_selector"], f"{where}.node_selector")
    if "tolerations" in body:
        values["tolerations"] = _tolerations(body["tolerations"], f"{where}.tolerations")
    return Profile(name=name, source=source, **values)


def _cpu(value: object, what: str) -> str:
    # A whole number of cores is unambiguous as a TOML integer; anything else is a string.
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not _CPU.match(value) or _zero(value):
        raise UsageError(
            f'{what} must be a CPU quantity above 0 such as "500m" or "2", not {value!r}'
        )
    return value


def _memory(value: object, what: str) -> str:
    if isinstance(value, str) and value.endswith("m") and _CPU.match(value):
        # Valid to Kubernetes, but millibytes: always a slip for "Mi".
        raise UsageError(f'{what} is {value!r}, which is millibytes: write "Mi" for mebibytes')
    if not isinstance(value, str) or not _MEMORY.match(value) or _zero(value):
        raise UsageError(
            f'{what} must be a memory quantity above 0 such as "512Mi" or "8Gi", not {value!r}'
        )
    return value


def _zero(quantity: str) -> bool:
    digits = re.match(_NUMBER, quantity)
    return digits is None or float(digits.group(0)) == 0


def _selector(raw: object, what: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, dict):
        raise UsageError(f"{what} must be a table of label key = value")
    out = []
    for key, value in raw.items():
        label_key(key, f"{what} key")
        if not isinstance(value, str):
            raise UsageError(f"{what}.{key} must be a string label value, not {value!r}")
        label_value(value, f"{what}.{key}")
        out.append((key, value))
    return tuple(sorted(out))


def label_key(key: str, what: str) -> None:
    """A Kubernetes label key: an optional DNS-subdomain prefix and '/', then a name."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        raise UsageError(f"{what} {key!r}: its prefix must be a DNS subdomain")
    if not _LABEL_NAME.match(name):
        raise UsageError(
            f"{what} {key!r} is not a label key (at most 63 of A-Z a-z 0-9 . _ -, "
            "alphanumeric at both ends, after an optional prefix/)"
        )


def label_value(value: str, what: str) -> None:
    if value and not _LABEL_NAME.match(value):
        raise UsageError(
            f"{what} {value!r} is not a label value (at most 63 of A-Z a-z 0-9 . _ -, "
            "alphanumeric at both ends)"
        )


def _tolerations(raw: object, what: str) -> tuple[Toleration, ...]:
    if not isinstance(raw, list):
        raise UsageError(f"{what} must be an array of tables ([[...tolerations]] or [{{...}}])")
    return tuple(_toleration(item, f"{what}[{i}]") for i, item in enumerate(raw))


def _toleration(item: object, what: str) -> Toleration:
    if not isinstance(item, dict):
        raise UsageError(f"{what} must be a table (key, operator, value, effect)")
    for field in item:
        if field not in _TOLERATION_FIELDS:
            known = ", ".join(_TOLERATION_FIELDS)
            raise UsageError(f"{what}: unknown field {field!r} (known: {known})")
    for field in ("key", "operator", "value", "effect"):
        if field in item and not isinstance(item[field], str):
            raise UsageError(f"{what}.{field} must be a string, not {item[field]!r}")
    key, value = item.get("key", ""), item.get("value", "")
    operator, effect = item.get("operator", "Equal"), item.get("effect", "")
    if operator not in OPERATORS:
        raise UsageError(f"{what}.operator must be Equal or Exists, not {operator!r}")
    if key:
        label_key(key, f"{what}.key")
    elif operator != "Exists":
        raise UsageError(f"{what}.key may be empty only with operator Exists (tolerate all)")
    if operator == "Exists" and value:
        raise UsageError(f"{what}.value must be empty with operator Exists")
    label_value(value, f"{what}.value")
    if effect and effect not in EFFECTS:
        raise UsageError(f"{what}.effect must be one of {', '.join(EFFECTS)}, not {effect!r}")
    seconds = item.get("toleration_seconds")
    if seconds is not None:
        if effect != "NoExecute":
            raise UsageError(f"{what}.toleration_seconds applies only with effect NoExecute")
        if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 0:
            raise UsageError(f"{what}.toleration_seconds must be a whole number of seconds >= 0")
    return Toleration(
        key=key, operator=operator, value=value, effect=effect, toleration_seconds=seconds
    )

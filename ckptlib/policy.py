"""`|` for policy objects: the one base that save-decision and retention policies share.

A family of policies (`save_policy`, `retention`) has a protocol its members satisfy and an
"any of" policy that `a | b` builds; members name that class in their class statement
(`class EveryNSteps(Combinable, any_of=AnySavePolicy)`), and the any-of class derives from
`AnyOfPolicies`, which flattens nested combinations and refuses non-members.
"""

from __future__ import annotations

from typing import Any, ClassVar


class Combinable:
    """A policy that combines with `|` (save if any says so, keep if any keeps) with any object
    satisfying its family's protocol, including a user's own policy on either side."""

    _any_of: ClassVar[type[AnyOfPolicies]]

    def __init_subclass__(cls, *, any_of: type[AnyOfPolicies] | None = None, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if any_of is not None:
            cls._any_of = any_of

    def __or__(self, other: Any) -> Any:
        if not isinstance(other, self._any_of.member):
            return NotImplemented
        return self._any_of((self, other))

    def __ror__(self, other: Any) -> Any:
        if not isinstance(other, self._any_of.member):
            return NotImplemented
        return self._any_of((other, self))


class AnyOfPolicies(Combinable):
    """The base of a family's "any of" policy (a frozen dataclass with a `policies` tuple):
    `member` is the family's protocol, `what` names a member in errors. Nested combinations
    are flattened, so `a | b | c` holds three policies."""

    member: ClassVar[type]
    what: ClassVar[str]
    policies: tuple

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(any_of=cls, **kwargs)

    def __post_init__(self) -> None:
        flat: list = []
        for policy in self.policies:
            if not isinstance(policy, self.member):
                raise TypeError(f"not a {self.what}: {policy!r}")
            flat.extend(policy.policies if isinstance(policy, type(self)) else (policy,))
        object.__setattr__(self, "policies", tuple(flat))


__all__ = ["AnyOfPolicies", "Combinable"]

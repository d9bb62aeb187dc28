"""What to send: request specs per QoS class, prompt shapes and arrival times.

Pure and seeded: the same arguments always give the same requests in the same
order, so two runs against two servers see identical work.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

QOS_CLASSES = ("realtime", "normal", "background")


@dataclass(frozen=True, slots=True)
class LengthRange:
    low: int
    high: int  # inclusive

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(
                f"length range {self.low}:{self.high} is not 1 <= low <= high"
            )

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """``"64"`` or ``"32:128"``."""
        low, _, high = text.partition(":")
        try:
            return cls(int(low), int(high or low))
        except ValueError as e:
            raise ValueError(f"bad length range {text!r}: {e}") from None

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(frozen=True, slots=True)
class ClassSpec:
    """One QoS class of the workload."""

    qos: str = "normal"
    share: float = 1.0  # fraction of requests (closed loop / no class rate)
    rate: float | None = None  # requests/s of this class in open loop
    input_len: LengthRange = LengthRange(128, 128)
    output_len: LengthRange = LengthRange(64, 64)
    deadline_ms: int = 0  # time-to-first-token deadline sent with each request

    def __post_init__(self) -> None:
        if self.deadline_ms < 0:
            raise ValueError("deadline must be >= 0 ms")
        if self.qos not in QOS_CLASSES:
            raise ValueError(f"unknown QoS class {self.qos!r}; one of {QOS_CLASSES}")
        if self.share <= 0 or (self.rate is not None and self.rate <= 0):
            raise ValueError("share and rate must be > 0")

    @classmethod
    def parse(cls, text: str, default: ClassSpec) -> ClassSpec:
        """``"realtime:share=0.2,rate=2,input=32:64,output=16,deadline=500"``."""
        qos, _, opts = text.partition(":")
        values: dict[str, object] = {"qos": qos.strip()}
        for item in filter(None, (o.strip() for o in opts.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"bad class option {item!r} (expected key=value)")
            if key == "share":
                values["share"] = float(value)
            elif key == "rate":
                values["rate"] = float(value)
            elif key == "input":
                values["input_len"] = LengthRange.parse(value)
            elif key == "output":
                values["output_len"] = LengthRange.parse(value)
            elif key == "deadline":
                values["deadline_ms"] = int(value)
            else:
                raise ValueError(f"unknown class option {key!r}")
        merged = {
            "share": default.share,
            "rate": default.rate,
            "input_len": default.input_len,
            "output_len": default.output_len,
        } | values
        return cls(**merged)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class PrefixGroups:
    """``groups`` shared prefixes of ``length`` tokens; every prompt starts with one."""

    groups: int
    length: int

    def __post_init__(self) -> None:
        if self.groups < 1 or self.length < 1:
            raise ValueError("prefix groups and length must be >= 1")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    qos: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival_s: float  # offset from the start of the run; 0 in closed loop
    prefix_group: int | None = None
    deadline_ms: int = 0


@dataclass(frozen=True, slots=True)
class Workload:
    classes: tuple[ClassSpec, ...] = (ClassSpec(),)
    prefix: PrefixGroups | None = None
    vocab: tuple[int, int] = (3, 1000)  # token ids drawn from [low, high)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError("the workload needs at least one class")
        if not 0 <= self.vocab[0] < self.vocab[1]:
            raise ValueError("vocab range must be 0 <= low < high")

    def requests(self, rate: float | None = None) -> Iterator[RequestSpec]:
        """Endless request specs. With ``rate`` (or per-class rates) arrivals are a
        Poisson process (open loop); otherwise every ``arrival_s`` is 0."""
        rng = random.Random(self.seed)
        prefixes = self._prefixes(rng)
        class_rates = [c.rate for c in self.classes]
        open_loop = rate is not None or any(r is not None for r in class_rates)
        if open_loop and any(r is None for r in class_rates) and rate is None:
            raise ValueError("give --rate or a rate for every class")
        shares = [c.share for c in self.classes]
        total_share = sum(shares)
        rates = [
            r if r is not None else (rate or 0.0) * s / total_share
            for r, s in zip(class_rates, shares, strict=True)
        ]
        next_arrival = [rng.expovariate(r) if open_loop else 0.0 for r in rates]
        index = 0
        while True:
            if open_loop:
                k = min(range(len(rates)), key=next_arrival.__getitem__)
                arrival = next_arrival[k]
                next_arrival[k] += rng.expovariate(rates[k])
            else:
                k = rng.choices(range(len(shares)), weights=shares)[0]
                arrival = 0.0
            yield self._request(index, self.classes[k], arrival, prefixes, rng)
            index += 1

    def _prefixes(self, rng: random.Random) -> list[tuple[int, ...]]:
        if self.prefix is None:
            return []
        lo, hi = self.vocab
        return [
            tuple(rng.randrange(lo, hi) for _ in range(self.prefix.length))
            for _ in range(self.prefix.groups)
        ]

    def _request(
        self,
        index: int,
        spec: ClassSpec,
        arrival: float,
        prefixes: list[tuple[int, ...]],
        rng: random.Random,
    ) -> RequestSpec:
        lo, hi = self.vocab
        group = rng.randrange(len(prefixes)) if prefixes else None
        head = prefixes[group] if group is not None else ()
        suffix_len = spec.input_len.draw(rng)
        suffix = tuple(rng.randrange(lo, hi) for _ in range(suffix_len))
        return RequestSpec(
            index=index,
            qos=spec.qos,
            prompt=head + suffix,
            max_tokens=spec.output_len.draw(rng),
            arrival_s=arrival,
            prefix_group=group,
            deadline_ms=spec.deadline_ms,
        )

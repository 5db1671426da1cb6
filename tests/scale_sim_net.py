"""The network of the scale simulation (tests/scale_sim.py): where peers sit, true RTTs, delays.

Nothing here is library code; every figure is an assumption, stated once:

- five regions on a 2-D map in milliseconds of RTT (shares of peers in brackets): us-east (30%),
  europe (30%), us-west (15%), asia (15%), south-america (10%); between region centres 53-197 ms;
- a peer sits at its region's centre plus a Gaussian offset (sigma 6 ms per axis) and has an access
  link adding 1-8 ms to every RTT of it, so RTTs inside a region are about 5-40 ms;
- each pair's path detours by 0-15% (a fixed, hashed factor): the triangle inequality does not
  quite hold, as on the Internet, so Vivaldi's embedding is never exact;
- a ping measures the true RTT plus queueing (exponential, mean 2 ms) and, one time in 20, a
  20-100 ms spike (a busy host);
- a DHT store or get over this WAN takes a lognormal time (medians 0.45 s and 0.35 s, sigma 0.5):
  a lookup of a few sequential RTTs to nodes anywhere.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

import numpy as np

_MS = 1e-3
_MAP_SCALE = 0.85  # the map below, scaled so that the farthest centres are 197 ms apart
REGIONS: dict[str, tuple[float, tuple[float, float]]] = {
    # name: (share of peers, centre on the map in ms)
    "us-east": (0.30, (0.0, 0.0)),
    "us-west": (0.15, (62.0, 0.0)),
    "europe": (0.30, (-70.0, 30.0)),
    "asia": (0.15, (120.0, 95.0)),
    "south-america": (0.10, (-20.0, -90.0)),
}
OFFSET_SIGMA_MS = 6.0
ACCESS_MS = (1.0, 8.0)
DETOUR = 0.15
QUEUE_MEAN_MS = 2.0
SPIKE_CHANCE, SPIKE_MS = 0.05, (20.0, 100.0)
STORE_MEDIAN_S, GET_MEDIAN_S, DELAY_SIGMA = 0.45, 0.35, 0.5


@dataclass(frozen=True)
class Site:
    """Where one peer sits: its region, point on the map (ms) and access link (ms)."""

    region: str
    x: float
    y: float
    access: float


def draw_site(rng: random.Random) -> Site:
    """A new peer's site: a region drawn by share, a point near its centre, an access link."""
    names = list(REGIONS)
    region = rng.choices(names, weights=[REGIONS[n][0] for n in names])[0]
    cx, cy = REGIONS[region][1]
    return Site(
        region,
        cx * _MAP_SCALE + rng.gauss(0.0, OFFSET_SIGMA_MS),
        cy * _MAP_SCALE + rng.gauss(0.0, OFFSET_SIGMA_MS),
        rng.uniform(*ACCESS_MS),
    )


def true_rtt(a: Site, b: Site, ids: tuple[int, int]) -> float:
    """Seconds: map distance plus both access links, times the pair's fixed detour."""
    low, high = min(ids), max(ids)
    h = hashlib.sha256(b"detour %d %d" % (low, high)).digest()
    detour = 1.0 + DETOUR * int.from_bytes(h[:4], "big") / 2**32
    return (math.hypot(a.x - b.x, a.y - b.y) + a.access + b.access) * detour * _MS


def true_rtts(sites: list[Site], one: Site) -> np.ndarray:
    """Seconds from ``one`` to every site, without the detour (for choosing near peers)."""
    xy = np.array([(s.x, s.y) for s in sites])
    access = np.array([s.access for s in sites])
    return (np.hypot(xy[:, 0] - one.x, xy[:, 1] - one.y) + access + one.access) * _MS


def ping(rtt: float, rng: random.Random) -> float:
    """What one ping measures on a path of true RTT ``rtt`` (seconds)."""
    sample = rtt + rng.expovariate(1.0 / (QUEUE_MEAN_MS * _MS))
    if rng.random() < SPIKE_CHANCE:
        sample += rng.uniform(*SPIKE_MS) * _MS
    return sample


def store_delay(rng: random.Random) -> float:
    """Seconds until a DHT store is readable (its lookup and the stores to the k closest)."""
    return STORE_MEDIAN_S * math.exp(rng.gauss(0.0, DELAY_SIGMA))


def get_delay(rng: random.Random) -> float:
    """Seconds a DHT get takes (a value lookup that ends at the read quorum)."""
    return GET_MEDIAN_S * math.exp(rng.gauss(0.0, DELAY_SIGMA))


def embedded(
    site: Site, dims: int, noise_ms: float, rng: random.Random
) -> tuple[tuple[float, ...], float]:
    """The Vivaldi vector and height (seconds) that fit ``site``'s RTTs best (its point on the
    map, its access link as the height), each component off by up to ``noise_ms``."""
    point = [site.x, site.y] + [0.0] * (dims - 2)
    vector = tuple((c + rng.uniform(-noise_ms, noise_ms)) * _MS for c in point)
    return vector, max(site.access + rng.uniform(-noise_ms, noise_ms), 0.01) * _MS

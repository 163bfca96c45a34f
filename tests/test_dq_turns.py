"""The deterministic dQ's rotated turn order (kernels_cu/bwd.cuh KeyBlockPairs::rotate_start,
DqTurns::ahead_rotated), transcribed: its closed form must give every block of a head a
distinct place on every pair, the place of its walk in the order the walks reach the pair.
A wrong count would hang the GPU kernel (a turn that never comes) or make two blocks add at
once (dQ no longer the same bits in every run); the GPU tests run the kernel itself."""

import pytest


def rotate_start(x, blocks, count):
    return x * count // blocks


def ahead_rotated(x, it, blocks, count):
    """bwd.cuh DqTurns::ahead_rotated: blocks that add into the pair block x reaches at step
    `it` before it."""
    start = rotate_start(x, blocks, count)
    end = start + it

    def starting_by(v):   # blocks whose start is <= v
        return min(blocks, ((v + 1) * blocks + count - 1) // count)

    later = (starting_by(end) - starting_by(start) if end < count
             else blocks - starting_by(start) + starting_by(end - count))
    return later + x - starting_by(start - 1)


def walk_order(pair, blocks, count):
    """The blocks in the order their walks reach `pair` (ties to the lower block)."""
    def step(y):
        return (pair - rotate_start(y, blocks, count)) % count
    return sorted(range(blocks), key=lambda y: (step(y), y))


@pytest.mark.parametrize("count", [1, 2, 3, 7, 16, 32, 33, 100])
@pytest.mark.parametrize("blocks", [1, 2, 5, 16, 33])
def test_rotated_turns_follow_the_walks(blocks, count):
    for pair in range(count):
        order = walk_order(pair, blocks, count)
        for place, x in enumerate(order):
            it = (pair - rotate_start(x, blocks, count)) % count   # the step at which x reaches the pair
            assert ahead_rotated(x, it, blocks, count) == place

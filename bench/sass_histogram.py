"""Count SASS opcodes of a cubin (``cuobjdump -sass`` output on stdin), most frequent first."""
import collections
import re
import sys

ops = collections.Counter(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_]*)", sys.stdin.read()))
print(f"{sum(ops.values())} instructions:", ", ".join(f"{op} {n}" for op, n in ops.most_common(25)))

// Which SASS mma.m16n8k16.f64 becomes on sm_90a (one DMMA or two): bench/fp64_profile.sh.
extern "C" __global__ void k16(double* x) {
    int i = threadIdx.x;
    double a[8], b[4], c[4];
    for (int j = 0; j < 8; ++j) a[j] = x[i * 16 + j];
    for (int j = 0; j < 4; ++j) { b[j] = x[i * 16 + 8 + j]; c[j] = x[i * 16 + 12 + j]; }
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7,%8,%9,%10,%11}, {%12,%13,%14,%15}, {%0,%1,%2,%3};\n"
        : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
        : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]),
          "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]));
    for (int j = 0; j < 4; ++j) x[i * 16 + j] = c[j];
}

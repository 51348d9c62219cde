// verify_qmm: the body of an `mx.fast.metal_kernel` (MLX writes the signature from the
// input/output names, the template arguments and the attribute names used below).
//
//   y[m, n] = sum_k x[m, k] * (scales[n, k / GS] * q[n, k] + biases[n, k / GS])
//
// x: (M, K) activations (T), M == MB <= 16 (compiled per row count: no padded rows of
// work); w: (N, K * BITS / 32) packed uint32, value j of a word in bits
// [j * BITS, (j + 1) * BITS); scales, biases: (N, K / GS) (T); y: (M, N).
// One threadgroup = SGS simdgroups x COLS output columns. Each K chunk of x is staged once
// in threadgroup memory, as float4, for all SGS * COLS columns; each lane then reads VALS
// weights of a column once and applies them to all M rows with two float4 dots, so every
// weight is read exactly once per call and x once per 16 columns.
constexpr int SIMD = 32;
constexpr int SGS = 4;
constexpr int COLS = 4;
constexpr int VALS = 8;  // two float4 per lane
constexpr int CHUNK = SIMD * VALS;
constexpr int CHUNK4 = CHUNK / 4;
constexpr int PER_WORD = 32 / BITS;
constexpr int WORDS = VALS / PER_WORD;
constexpr uint MASK = (1u << BITS) - 1u;

threadgroup float4 xs[MB][CHUNK4];

const int M = x_shape[0];
const int K = x_shape[1];
const int N = w_shape[0];
const int KW = K / PER_WORD;  // words per weight row
const int KG = K / GS;        // groups per weight row
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const int n0 = (int(threadgroup_position_in_grid.x) * SGS + int(simdgroup_index_in_threadgroup)) * COLS;

float acc[MB][COLS];
for (int m = 0; m < MB; m++) {
  for (int c = 0; c < COLS; c++) {
    acc[m][c] = 0.0f;
  }
}

for (int k0 = 0; k0 < K; k0 += CHUNK) {
  // Stage x[:, k0 : k0 + CHUNK] four values at a time (zeros past M and K; K is a
  // multiple of 32, so a float4 is all in range or all out).
  for (uint i = tid; i < uint(MB * CHUNK4); i += SGS * SIMD) {
    const int m = int(i) / CHUNK4;
    const int k = k0 + 4 * (int(i) % CHUNK4);
    const int at = m * K + k;
    xs[m][i % CHUNK4] = (m < M && k < K) ? float4(float(x[at]), float(x[at + 1]), float(x[at + 2]), float(x[at + 3]))
                                         : float4(0.0f);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // K is a multiple of GS (>= 32), so a lane's VALS values are all in range or all out,
  // and all in one quantization group.
  const int k = k0 + int(lane) * VALS;
  if (k < K) {
    float xsum[MB];
    for (int m = 0; m < MB; m++) {
      xsum[m] = dot(xs[m][2 * lane] + xs[m][2 * lane + 1], float4(1.0f));
    }
    for (int c = 0; c < COLS; c++) {
      const int n = n0 + c;
      if (n < N) {
        const float scale = float(scales[n * KG + k / GS]);
        const float bias = float(biases[n * KG + k / GS]);
        float q[VALS];
        for (int j = 0; j < WORDS; j++) {
          const uint word = w[n * KW + k / PER_WORD + j];
          for (int v = 0; v < PER_WORD; v++) {
            q[j * PER_WORD + v] = float((word >> (v * BITS)) & MASK);
          }
        }
        const float4 lo = float4(q[0], q[1], q[2], q[3]);
        const float4 hi = float4(q[4], q[5], q[6], q[7]);
        for (int m = 0; m < MB; m++) {
          const float d = dot(xs[m][2 * lane], lo) + dot(xs[m][2 * lane + 1], hi);
          acc[m][c] += scale * d + bias * xsum[m];
        }
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Compile-time bounds keep acc in registers; m < M is the same for every lane, so each
// simd_sum is called by the whole simdgroup.
for (int c = 0; c < COLS; c++) {
  const int n = n0 + c;
  for (int m = 0; m < MB; m++) {
    if (m < M) {
      const float total = simd_sum(acc[m][c]);
      if (lane == 0 && n < N) {
        y[m * N + n] = static_cast<T>(total);
      }
    }
  }
}

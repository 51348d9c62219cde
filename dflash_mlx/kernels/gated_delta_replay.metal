// gated_delta_replay: the body of an `mx.fast.metal_kernel` (MLX writes the signature).
//
// The gated delta rule over T recorded tokens, state only (no readout), per head h:
//   S <- S * g[t, h]
//   S <- S + k_t (beta[t, h] (v_t - S k_t))^T      (S: (Dv, Dk); S k_t: (Dv,))
// in float32, the products in mlx-lm's order (decay, then kv = S k, then the update).
//
// state_in, state_out: (B, Hv, Dv, Dk); k: (B, T, Hk, Dk); v: (B, T, Hv, Dv);
// g: (B, T, Hv) float32; beta: (B, T, Hv); T <= MAX_T; value head h reads key head
// h / (Hv / Hk). Grid (32, Dv, B * Hv): one simdgroup per state row (b, h, dv), lane l
// holding elements [l * PER, (l + 1) * PER) of it in registers (PER = ceil(Dk / 32),
// Dk's tail masked), as mlx-lm's own kernel splits a row, so each S k sums the same
// partials. All rows of a threadgroup share (b, h): the threadgroup first stages that
// head's k, g and beta for every token in threadgroup memory, read once from device.
constexpr int SIMD = 32;
constexpr int PER = (Dk + SIMD - 1) / SIMD;

threadgroup float ks[MAX_T * Dk];
threadgroup float gs[MAX_T];
threadgroup float bs[MAX_T];

const int T = k_shape[1];
const int n = int(thread_position_in_grid.z);  // b * Hv + h
const int b = n / Hv;
const int hk = n % Hv / (Hv / Hk);
const int dv = int(thread_position_in_grid.y);
const int lane = int(thread_index_in_simdgroup);
const int tid = int(thread_position_in_threadgroup.y * threads_per_threadgroup.x + thread_position_in_threadgroup.x);
const int threads = int(threads_per_threadgroup.x * threads_per_threadgroup.y);

for (int i = tid; i < T * Dk; i += threads) {
  const int t = i / Dk;
  ks[i] = float(k[((b * T + t) * Hk + hk) * Dk + i % Dk]);
}
for (int t = tid; t < T; t += threads) {
  gs[t] = float(g[b * T * Hv + t * Hv + n % Hv]);
  bs[t] = float(beta[b * T * Hv + t * Hv + n % Hv]);
}
threadgroup_barrier(mem_flags::mem_threadgroup);

const int row = (n * Dv + dv) * Dk;
float s[PER];
for (int i = 0; i < PER; i++) {
  const int e = lane * PER + i;
  s[i] = e < Dk ? float(state_in[row + e]) : 0.0f;
}
for (int t = 0; t < T; t++) {
  float kv = 0.0f;
  for (int i = 0; i < PER; i++) {
    const int e = lane * PER + i;
    s[i] = s[i] * gs[t];
    kv += e < Dk ? s[i] * ks[t * Dk + e] : 0.0f;
  }
  kv = simd_sum(kv);
  const float delta = (float(v[(b * T + t) * Hv * Dv + (n % Hv) * Dv + dv]) - kv) * bs[t];
  for (int i = 0; i < PER; i++) {
    const int e = lane * PER + i;
    s[i] = e < Dk ? s[i] + ks[t * Dk + e] * delta : 0.0f;
  }
}
for (int i = 0; i < PER; i++) {
  const int e = lane * PER + i;
  if (e < Dk) {
    state_out[row + e] = static_cast<StT>(s[i]);
  }
}

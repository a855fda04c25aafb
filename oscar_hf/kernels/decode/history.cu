// History programs of the decode's stage 1 in CUDA (sm_80+): one warp per split of one (batch, KV head), its tiles
// streamed through a ring of shared-memory stages by cp.async; a block's warps are consecutive programs that share
// nothing but the block's shared memory. Same inputs and outputs as the Triton kernel's history programs
// (decode/triton.py): the partial output of each split, normalised, and its log-sum-exp (base 2, scaled).
//
// Compiled by NVRTC at first use, one module per configuration; the Python side prepends the constants:
//   D, K_BITS, V_BITS, FP16 (0: bf16), TN (tokens per tile), STAGES, HAS_MASK, WARPS (programs per block).
// No headers: bf16/fp16 values are 16-bit integers and every conversion is inline PTX.
//
// Layout. Per 16-token sub-tile (the MMA's M = 16 rows of tokens):
//   logits [16 tokens x 8 query heads] = K codes [16 x D] . q^T      (mma m16n8k16, A = codes, B = q/f)
//   out^T  [D channels x 8 query heads] += V codes^T [D x 16] . P    (A = codes, B = (p.s) transposed by movmatrix)
// Row r of sub-tile s (an MMA row, or a k index of the V dot) is token TPT.(r % 8) + 2s + r / 8 of the tile (TPT =
// 2.SUB tokens per thread), so that the tokens of a thread's logit rows are contiguous (its scales and zeros are one
// vector load). A thread (gid = lane / 4, tig = lane % 4) reads the K bytes [tig.W_K/4, (tig+1).W_K/4) of rows gid
// and gid + 8, and the V bytes [gid.W_V/8, (gid+1).W_V/8) of rows 2tig, 2tig+1, 2tig+8, 2tig+9. Which channel each
// fragment slot holds follows from those bytes (byte j of a row holds channels j + i.W at bit i.bits); q is loaded
// in the same order, so the channel order inside the dots is free. Codes become dot operands by magic numbers:
// (x >> shift) & mask | magic read as bf16 (fp16) is M + c.f (M = 128 or 1024), two per lop3; 1/f goes into q and
// into the output, the offset M out through sum(q/f) for K and sum(p.s) for V (docs/kernels/decode.md).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

constexpr int W_K = D * K_BITS / 8;                  // bytes per K code row
constexpr int W_V = D * V_BITS / 8;
constexpr int MANTISSA = FP16 ? 10 : 7;
constexpr u32 MAGIC = FP16 ? 0x6400u : 0x4300u;      // M = 1024 (fp16) or 128 (bf16)
constexpr float M_VALUE = FP16 ? 1024.0f : 128.0f;
constexpr int PER_K = MANTISSA / K_BITS;             // positions one shift serves
constexpr int PER_V = MANTISSA / V_BITS;
constexpr int NPOS_K = 16 / K_BITS;                  // positions per halfword
constexpr int NPOS_V = 16 / V_BITS;
constexpr int BPT_K = W_K / 4;                       // K bytes per thread and token row
constexpr int BPT_V = W_V / 8;                       // V bytes per thread and token row
constexpr int NWK = BPT_K / 4;                       // K words per thread and row
constexpr int NHW_V = BPT_V / 2;                     // V halfwords per thread and row
constexpr int KS = D / 16;                           // K dots per sub-tile (k-steps)
constexpr int MT = D / 16;                           // V dots per sub-tile (m-tiles of channels)
constexpr int SUB = TN / 16;                         // sub-tiles per tile
constexpr int TPT = 2 * SUB;                         // tokens per thread and tile: rows gid, gid + 8 of each sub-tile
constexpr float CENTER = ((1 << V_BITS) - 1) * 0.5f;
#define NEG_INF __int_as_float(0xff800000)
constexpr float SLACK = FP16 ? 0.0f : 8.0f;          // lazy rescaling: p <= 2**SLACK (fp16's p.s could overflow)
// one stage: K codes, V codes, K scale, K zero, V scale, V zero
constexpr int OFF_V = TN * W_K;
constexpr int OFF_META = OFF_V + TN * W_V;
constexpr int STAGE_BYTES = OFF_META + 8 * TN;

static_assert(NWK >= 1 && BPT_V >= 2, "head_dim too small for this layout");
static_assert(TN % 16 == 0 && (TN * W_K) % 16 == 0 && (TN * 2) % 16 == 0, "tile");

__device__ __forceinline__ u32 unpack2(u32 x, u32 mask) {  // (x & mask) | magic, both halfwords
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(x), "r"(mask), "r"(MAGIC * 0x10001u));
    return d;
}

// Position p of the codes of a 32-bit word (two halfwords, BITS-bit codes) as a dot operand: two values M + c.f
template <int BITS>
__device__ __forceinline__ u32 operand(u32 word, int p) {
    constexpr int PER = MANTISSA / BITS;  // positions one shift serves
    const u32 bits = ((1u << BITS) - 1) << (p % PER * BITS);
    return unpack2(word >> (p / PER * PER * BITS), bits * 0x10001u);
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if FP16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ u32 transpose8x8(u32 x) {
    u32 d;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(x));
    return d;
}

__device__ __forceinline__ u32 pack2(float lo, float hi) {  // rounded to nearest even
    u32 d;
#if FP16
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
#endif
    return d;
}

__device__ __forceinline__ float half_to_float(u16 h) {  // the dot dtype's value of a 16-bit pattern
#if FP16
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return __uint_as_float(((u32)h) << 16);
#endif
}

__device__ __forceinline__ float f16_to_float(u16 h) {  // scales and zeros are fp16
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ u32 shared_address(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}

__device__ __forceinline__ void copy16(u32 dst, const void* src, bool valid) {  // zeros where not valid
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ float warp_max_rows(float x) {  // max over the 8 lanes of one tig (the tokens)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}

__device__ __forceinline__ float warp_sum_rows(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 4);
    x += __shfl_xor_sync(0xffffffffu, x, 8);
    return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

__device__ __forceinline__ int token(int sub, int row) { return TPT * (row % 8) + 2 * sub + row / 8; }

template <int N> struct Vec;  // N halves as one shared-memory load
template <> struct Vec<2> { typedef u32 T; };
template <> struct Vec<4> { typedef uint2 T; };
template <> struct Vec<8> { typedef uint4 T; };

// channel and 1/f of K pair slot (word wi, halfword e, position p) of a thread with this tig
__device__ __forceinline__ int key_channel(int tig, int wi, int e, int p) {
    const int j = tig * BPT_K + 4 * wi + 2 * e + p * K_BITS / 8;
    return j + (p * K_BITS % 8 / K_BITS) * W_K;
}

__device__ __forceinline__ int value_channel(int gid, int hw, int p) {
    const int j = gid * BPT_V + 2 * hw + p * V_BITS / 8;
    return j + (p * V_BITS % 8 / V_BITS) * W_V;
}

// Loads tile `tile` (tokens tile.TN ...) of one (batch, KV head) into a stage; tokens from n_hist on are zeros
// where a 16-byte chunk starts past them.
__device__ __forceinline__ void load_tile(unsigned char* stage, int tile, int n_hist, int lane,
                                          const unsigned char* kc, const unsigned char* vc, const u16* ks,
                                          const u16* kz, const u16* vs, const u16* vz) {
    const int start = tile * TN;
    const u32 base = shared_address(stage);
#pragma unroll
    for (int c = lane; c < TN * W_K / 16; c += 32)
        copy16(base + 16 * c, kc + (size_t)start * W_K + 16 * c, start + 16 * c / W_K < n_hist);
#pragma unroll
    for (int c = lane; c < TN * W_V / 16; c += 32)
        copy16(base + OFF_V + 16 * c, vc + (size_t)start * W_V + 16 * c, start + 16 * c / W_V < n_hist);
    constexpr int CHUNKS = TN / 8;  // 16-byte chunks of one scale/zero vector
#pragma unroll
    for (int c = lane; c < 4 * CHUNKS; c += 32) {
        const int a = c / CHUNKS, j = c % CHUNKS;
        const u16* src = (a == 0 ? ks : a == 1 ? kz : a == 2 ? vs : vz) + start + 8 * j;
        copy16(base + OFF_META + a * 2 * TN + 16 * j, src, start + 8 * j < n_hist);
    }
}

// A program's online softmax: per thread the output columns 2tig, 2tig + 1 (query heads) of its channel rows, the
// running max (scaled logits), and partial sums over its tokens of p, p.s (as rounded for the dots) and p.(z + c.s).
struct State {
    float o[MT][4];
    float m[2], den[2], ps[2], pz[2];
};

// One tile of the history from its stage: K dots of all sub-tiles (independent accumulators, so they interleave),
// one softmax step, then the V dots. WHOLE: every token of the tile is below n_hist (no bounds selects).
template <bool WHOLE>
__device__ __forceinline__ void attend_tile(State& st, const unsigned char* stage, int start, int n_hist, int gid,
                                            int tig, const u32 (&qb)[KS][2], float qoff0, float qoff1, float qsum0,
                                            float qsum1, float qk_scale, const unsigned char* mask_row,
                                            long long stride_mt) {
    u32 kw[SUB][2][NWK];
#pragma unroll
    for (int sub = 0; sub < SUB; ++sub)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int w = 0; w < NWK; ++w)
                kw[sub][r][w] = *(const u32*)(stage + token(sub, gid + 8 * r) * W_K + tig * BPT_K + 4 * w);
    float l[SUB][4];
#pragma unroll
    for (int sub = 0; sub < SUB; ++sub) {
        l[sub][0] = l[sub][2] = qoff0;
        l[sub][1] = l[sub][3] = qoff1;
    }
#pragma unroll
    for (int ksi = 0; ksi < KS; ++ksi) {
#pragma unroll
        for (int sub = 0; sub < SUB; ++sub) {
            u32 a[4];
#pragma unroll
            for (int slot = 0; slot < 2; ++slot) {
                const int pi = 2 * ksi + slot, wi = pi / NPOS_K, p = pi % NPOS_K;
                a[2 * slot] = operand<K_BITS>(kw[sub][0][wi], p);
                a[2 * slot + 1] = operand<K_BITS>(kw[sub][1][wi], p);
            }
            mma(l[sub], a[0], a[1], a[2], a[3], qb[ksi][0], qb[ksi][1]);
        }
    }
    // this thread's tokens are TPT.gid + j, j = 2.sub + row half: their scales and zeros are one load per vector
    typedef typename Vec<TPT>::T Meta;
    const u16* meta_s = (const u16*)(stage + OFF_META) + TPT * gid;
    const Meta sk_raw = *(const Meta*)meta_s, zk_raw = *(const Meta*)(meta_s + TN);
    const Meta sv_raw = *(const Meta*)(meta_s + 2 * TN), zv_raw = *(const Meta*)(meta_s + 3 * TN);
    const u16 *sk_h = (const u16*)&sk_raw, *zk_h = (const u16*)&zk_raw;
    const u16 *sv_h = (const u16*)&sv_raw, *zv_h = (const u16*)&zv_raw;
    float sv[TPT], mid[TPT];
    float tile0 = NEG_INF, tile1 = NEG_INF;  // this thread's max of columns 2tig, 2tig + 1
#pragma unroll
    for (int sub = 0; sub < SUB; ++sub) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int j = 2 * sub + r;
            const float sk = f16_to_float(sk_h[j]) * qk_scale, zk = f16_to_float(zk_h[j]);
            sv[j] = f16_to_float(sv_h[j]);
            mid[j] = f16_to_float(zv_h[j]) + CENTER * sv[j];
            float x0 = sk * l[sub][2 * r] + zk * qsum0;  // qsum and sk carry qk_scale
            float x1 = sk * l[sub][2 * r + 1] + zk * qsum1;
            bool live = true;
            if (!WHOLE) {  // tokens past the history: no weight, and scales that may be garbage are not read
                live = start + TPT * gid + j < n_hist;
                sv[j] = live ? sv[j] : 0.0f;
                mid[j] = live ? mid[j] : 0.0f;
            }
#if HAS_MASK
            live = live && mask_row[(long long)(TPT * gid + j) * stride_mt] != 0;
#endif
            if (!WHOLE || HAS_MASK) {
                x0 = live ? x0 : NEG_INF;
                x1 = live ? x1 : NEG_INF;
            }
            l[sub][2 * r] = x0;
            l[sub][2 * r + 1] = x1;
            tile0 = fmaxf(tile0, x0);
            tile1 = fmaxf(tile1, x1);
        }
    }
    if (__any_sync(0xffffffffu, tile0 - st.m[0] > SLACK || tile1 - st.m[1] > SLACK)) {  // rare once settled
        const float n0 = fmaxf(st.m[0], warp_max_rows(tile0)), n1 = fmaxf(st.m[1], warp_max_rows(tile1));
        const float alpha[2] = {fast_exp2(st.m[0] - n0), fast_exp2(st.m[1] - n1)};
        st.m[0] = n0;
        st.m[1] = n1;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            st.den[c] *= alpha[c];
            st.ps[c] *= alpha[c];
            st.pz[c] *= alpha[c];
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            st.o[mt][0] *= alpha[0]; st.o[mt][2] *= alpha[0];
            st.o[mt][1] *= alpha[1]; st.o[mt][3] *= alpha[1];
        }
    }
    // p.s as the V dots' B operand: rows gid, gid + 8 packed, then transposed to (k = 2tig, 2tig + 1 [+ 8]; head gid)
    u32 pb[SUB][2];
#pragma unroll
    for (int sub = 0; sub < SUB; ++sub) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int j = 2 * sub + r;
            const float p0 = fast_exp2(l[sub][2 * r] - st.m[0]), p1 = fast_exp2(l[sub][2 * r + 1] - st.m[1]);
            st.den[0] += p0; st.den[1] += p1;
            st.pz[0] += p0 * mid[j]; st.pz[1] += p1 * mid[j];
            const u32 x = pack2(p0 * sv[j], p1 * sv[j]);
#if FP16
            st.ps[0] += half_to_float((u16)x); st.ps[1] += half_to_float((u16)(x >> 16));
#else
            st.ps[0] += __uint_as_float(x << 16); st.ps[1] += __uint_as_float(x & 0xffff0000u);
#endif
            pb[sub][r] = transpose8x8(x);
        }
    }
    // V: rows 2tig, 2tig + 1, 2tig + 8, 2tig + 9 of each sub-tile, the bytes of this gid, two tokens per register
    u32 va[SUB][NHW_V], vb[SUB][NHW_V];
#pragma unroll
    for (int sub = 0; sub < SUB; ++sub) {
        const unsigned char* v0 = stage + OFF_V + token(sub, 2 * tig) * W_V + gid * BPT_V;
        const unsigned char* v1 = stage + OFF_V + token(sub, 2 * tig + 1) * W_V + gid * BPT_V;
        const unsigned char* v8 = stage + OFF_V + token(sub, 2 * tig + 8) * W_V + gid * BPT_V;
        const unsigned char* v9 = stage + OFF_V + token(sub, 2 * tig + 9) * W_V + gid * BPT_V;
#pragma unroll
        for (int hw = 0; hw < NHW_V; hw += 2) {
            if (NHW_V == 1) {
                const u32 t0 = *(const u16*)v0, t1 = *(const u16*)v1, t8 = *(const u16*)v8, t9 = *(const u16*)v9;
                va[sub][hw] = prmt(t0, t1, 0x5410);
                vb[sub][hw] = prmt(t8, t9, 0x5410);
            } else {
                const u32 t0 = *(const u32*)(v0 + 2 * hw), t1 = *(const u32*)(v1 + 2 * hw);
                const u32 t8 = *(const u32*)(v8 + 2 * hw), t9 = *(const u32*)(v9 + 2 * hw);
                va[sub][hw] = prmt(t0, t1, 0x5410);
                va[sub][hw + 1] = prmt(t0, t1, 0x7632);
                vb[sub][hw] = prmt(t8, t9, 0x5410);
                vb[sub][hw + 1] = prmt(t8, t9, 0x7632);
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int sub = 0; sub < SUB; ++sub) {
            u32 a[4];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int sl = 2 * mt + half, hw = sl / NPOS_V, p = sl % NPOS_V;
                a[half] = operand<V_BITS>(va[sub][hw], p);      // channel row gid (+8), k 2tig..
                a[2 + half] = operand<V_BITS>(vb[sub][hw], p);  // k 2tig + 8 ..
            }
            mma(st.o[mt], a[0], a[1], a[2], a[3], pb[sub][0], pb[sub][1]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(32 * WARPS) oscar_history(
    const u16* __restrict__ qr, long long stride_qb, long long stride_qh,
    const unsigned char* __restrict__ kc, const u16* __restrict__ ks, const u16* __restrict__ kz,
    const unsigned char* __restrict__ vc, const u16* __restrict__ vs, const u16* __restrict__ vz,
    long long stride_kcb, long long stride_kch, long long stride_vcb, long long stride_vch, long long stride_zb,
    long long stride_zh, const unsigned char* __restrict__ mask, long long stride_mb, long long stride_mt,
    float* __restrict__ part_o, float* __restrict__ part_lse, const int* __restrict__ counts, int hist_splits,
    int win_splits, int total_splits, int heads, int group_q, int programs, float qk_scale) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, tig = lane % 4;
    const int program = blockIdx.x * WARPS + warp;  // (batch, KV head) major, so a block's warps share a head
    if (program >= programs) return;
    const int bh = program / hist_splits, split = program % hist_splits;
    const long long b = bh / heads, h = bh % heads;
    const int n_sink = counts[0], n_hist = counts[1];
    unsigned char* ring = smem + warp * STAGES * STAGE_BYTES;
    const unsigned char* kcb = kc + b * stride_kcb + h * stride_kch;
    const unsigned char* vcb = vc + b * stride_vcb + h * stride_vch;
    const long long meta = b * stride_zb + h * stride_zh;
    const u16 *ksb = ks + meta, *kzb = kz + meta, *vsb = vs + meta, *vzb = vz + meta;
    const int tiles = split * TN < n_hist ? (n_hist - split * TN + hist_splits * TN - 1) / (hist_splits * TN) : 0;

    // start the pipeline before the query's loads: stage i holds the program's tile i
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < tiles) load_tile(ring + i * STAGE_BYTES, split + i * hist_splits, n_hist, lane, kcb, vcb, ksb, kzb, vsb, vzb);
        asm volatile("cp.async.commit_group;");
    }

    // q/f in the K slots' channel order (B fragments: column gid = query head gid), sum(q) and -M.sum(q/f)
    const bool head_live = gid < group_q;
    const u16* q = qr + b * stride_qb + (h * group_q + (head_live ? gid : 0)) * stride_qh;
    u32 qb[KS][2];
    float q_sum = 0.0f, q_scaled = 0.0f;
#pragma unroll
    for (int pi = 0; pi < 2 * KS; ++pi) {
        const int wi = pi / NPOS_K, p = pi % NPOS_K;
        const float inv_f = 1.0f / (float)(1 << (p % PER_K * K_BITS));
        float v[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float x = head_live ? half_to_float(q[key_channel(tig, wi, e, p)]) : 0.0f;
            q_sum += x;
            v[e] = x * inv_f;
            q_scaled += v[e];
        }
        qb[pi / 2][pi % 2] = pack2(v[0], v[1]);
    }
    q_sum += __shfl_xor_sync(0xffffffffu, q_sum, 1);
    q_sum += __shfl_xor_sync(0xffffffffu, q_sum, 2);
    q_scaled += __shfl_xor_sync(0xffffffffu, q_scaled, 1);
    q_scaled += __shfl_xor_sync(0xffffffffu, q_scaled, 2);
    // this thread's logit columns are query heads 2tig and 2tig + 1; sum(q) times the logit scale
    const float qsum0 = qk_scale * __shfl_sync(0xffffffffu, q_sum, 8 * tig);
    const float qsum1 = qk_scale * __shfl_sync(0xffffffffu, q_sum, 8 * tig + 4);
    const float qoff0 = -M_VALUE * __shfl_sync(0xffffffffu, q_scaled, 8 * tig);
    const float qoff1 = -M_VALUE * __shfl_sync(0xffffffffu, q_scaled, 8 * tig + 4);

    State st;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) st.o[mt][0] = st.o[mt][1] = st.o[mt][2] = st.o[mt][3] = 0.0f;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        st.m[c] = -1.0e30f;  // finite: a fully masked tile leaves alpha = 1 and p = 0
        st.den[c] = st.ps[c] = st.pz[c] = 0.0f;
    }

    int slot = 0;  // the stage of tile i
    for (int i = 0; i < tiles; ++i) {
        if (i + STAGES - 1 < tiles)
            load_tile(ring + (i + STAGES - 1) % STAGES * STAGE_BYTES, split + (i + STAGES - 1) * hist_splits, n_hist,
                      lane, kcb, vcb, ksb, kzb, vsb, vzb);
        asm volatile("cp.async.commit_group;");
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1));
        __syncwarp();
        const unsigned char* stage = ring + slot * STAGE_BYTES;
        slot = slot + 1 == STAGES ? 0 : slot + 1;
        const int start = (split + i * hist_splits) * TN;
        const unsigned char* mask_row = HAS_MASK ? mask + b * stride_mb + (long long)(n_sink + start) * stride_mt
                                                 : nullptr;
        if (start + TN <= n_hist)
            attend_tile<true>(st, stage, start, n_hist, gid, tig, qb, qoff0, qoff1, qsum0, qsum1, qk_scale, mask_row,
                              stride_mt);
        else
            attend_tile<false>(st, stage, start, n_hist, gid, tig, qb, qoff0, qoff1, qsum0, qsum1, qk_scale, mask_row,
                               stride_mt);
        __syncwarp();  // every lane is done with this stage before it is refilled
    }
    asm volatile("cp.async.wait_group 0;");

    const float den0 = warp_sum_rows(st.den[0]), den1 = warp_sum_rows(st.den[1]);
    const float ps0 = warp_sum_rows(st.ps[0]), ps1 = warp_sum_rows(st.ps[1]);
    const float pz0 = warp_sum_rows(st.pz[0]), pz1 = warp_sum_rows(st.pz[1]);
    const int out_split = win_splits + split;
    const long long row0 = (long long)bh * group_q;
    const float inv0 = 1.0f / (den0 > 0.0f ? den0 : 1.0f), inv1 = 1.0f / (den1 > 0.0f ? den1 : 1.0f);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int sl = 2 * mt + half, hw = sl / NPOS_V, p = sl % NPOS_V;
            const int ch = value_channel(gid, hw, p);
            const float inv_f = 1.0f / (float)(1 << (p % PER_V * V_BITS));
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int head = 2 * tig + c;
                if (head < group_q) {
                    const float ps = c ? ps1 : ps0, pz = c ? pz1 : pz0, inv = c ? inv1 : inv0;
                    const float val = ((st.o[mt][2 * half + c] - M_VALUE * ps) * inv_f + pz - CENTER * ps) * inv;
                    part_o[((row0 + head) * total_splits + out_split) * D + ch] = val;
                }
            }
        }
    }
    if (gid == 0) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int head = 2 * tig + c;
            const float den = c ? den1 : den0, m = st.m[c];
            if (head < group_q)
                part_lse[(row0 + head) * total_splits + out_split] = den > 0.0f ? m + __log2f(den) : NEG_INF;
        }
    }
}

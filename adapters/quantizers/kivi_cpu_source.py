"""C source of the CPU decode kernel over KIVI codes (compiled on first use by :mod:`kivi_cpu`).

One work item is one (batch row, KV head) and one split of its tokens. It walks its tokens a block of
``BN`` at a time and never builds a dequantized copy of the cache:

* keys (per-channel groups): for each group row ``g`` it forms ``qs = q * scale[g]`` and ``qz = q . zero[g]``
  once, then a token's logit is ``qs . codes + qz``: the codes become floats, nothing else;
* values (per-token groups): a token's codes become ``codes * scale + zero`` in a small buffer (in the
  field order of the packed bytes), folded into every row's accumulator with its weight;
* full-precision residual rows (and 16-bit streams) are read as they are.

Codes are unpacked a field at a time (``(byte >> shift) & mask`` over the token's bytes), so the unpacked
channels are in *field order* (channel ``m * per + f`` at ``f * W + m``); the key query scale and the value
accumulator use the same order, and the accumulator is put back in channel order at the end. Every split
keeps a running maximum, denominator and weighted sum per query row (online softmax); the splits are merged
per head after the threads join. Math in float32; threads are POSIX threads taking items off a counter.

Speed comes from the compiler, so the source is written for it: a work item is compiled three times, for head
dim 64, for 128 (every per-token loop then has a constant length and is unrolled and vectorised) and for any
other; the code width is a constant in each branch of the unpacking; the softmax's exponentials use an inline
``exp`` (a polynomial within 2 ulp of ``expf``) that vectorises where ``expf`` is a library call per element;
a group row's scale is folded into the queries in field order by strided reads (no division per channel);
tokens go four at a time where they can (four keys of one group row against each scaled query row, four
values into each row's sum), so the query rows and the sums are read and written once for four tokens;
pointers that never alias are marked ``restrict``.
"""

SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BN 64

typedef struct {
    const uint8_t *codes; const float *scale; const float *zero; const int32_t *gid; const float *res;
    int64_t c_b, c_h, c_t, s_b, s_h, s_t, g_b, g_h, g_t, r_b, r_h, r_t;
    const int64_t *nq; const int64_t *nr;      /* per-head counts, or NULL: every head holds nq_all / nr_all */
    int64_t nq_all, nr_all;
    int32_t layout, bits, group, pad;
} kv_stream;

typedef struct {
    const float *q; float *out;
    kv_stream k, v;
    int64_t B, H, M, qlen, d, dv, nsplit, chunk, nthreads;
    float scaling; int32_t next;
    float *pm, *pl, *pacc;
} kv_job;

static inline __attribute__((always_inline))
void unpack(const uint8_t *restrict c, int bits, int64_t d, float *restrict dst) {
    if (bits == 8) { for (int64_t m = 0; m < d; m++) dst[m] = (float)c[m]; return; }
    int per = 8 / bits, mask = (1 << bits) - 1;
    int64_t W = d / per;
    for (int f = 0; f < per; f++) {
        float *o = dst + f * W;
        int sh = f * bits;
        for (int64_t m = 0; m < W; m++) o[m] = (float)((c[m] >> sh) & mask);
    }
}

/* Codes of one token into floats in field order, with the width a constant in each branch (so every loop
   has a constant trip count when d is one). */
static inline __attribute__((always_inline))
void unpack_any(const uint8_t *restrict c, int bits, int64_t d, float *restrict dst) {
    if (bits == 4) unpack(c, 4, d, dst);
    else if (bits == 2) unpack(c, 2, d, dst);
    else unpack(c, 8, d, dst);
}

static inline int64_t field_pos(int64_t c, int bits, int64_t d) {  /* channel c -> its place in field order */
    int per = 8 / bits;
    return (c % per) * (d / per) + c / per;
}

/* exp(x) for x <= 0 (Cody-Waite reduction to |r| <= ln2 / 2 and Cephes' degree-6 polynomial, within 2 ulp
   of expf), written so that a loop over it vectorises: expf itself is a library call per element. */
static inline __attribute__((always_inline)) float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float k = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - k * 0.693359375f;
    r = r + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two = { .i = ((int32_t)k + 127) << 23 };
    return y * two.f;
}

/* One quantized value token dequantized into dst (field order): codes * scale + minimum of its group. */
static inline __attribute__((always_inline))
void value_row(const uint8_t *restrict c, const float *restrict st, const float *restrict zt, int bits, int per,
               int64_t group, int64_t dv, const int32_t *restrict gmap, float *restrict cb, float *restrict dst) {
    unpack_any(c, bits, dv, cb);
    const int64_t W = dv / per, run = group / per;
    if (group % per == 0) {                              /* a group is a run of bytes: G / per per field */
        for (int f = 0; f < per; f++)
            for (int64_t g = 0; g < dv / group; g++) {
                const float sg = st[g], zg = zt[g];
                const float *restrict x = cb + f * W + g * run;
                float *restrict y = dst + f * W + g * run;
                for (int64_t m = 0; m < run; m++) y[m] = x[m] * sg + zg;
            }
    } else {
        for (int64_t c2 = 0; c2 < dv; c2++) dst[c2] = cb[c2] * st[gmap[c2]] + zt[gmap[c2]];
    }
}

/* One work item; D and DV are the head dims (constants in the specialised copies below, so the per-token
   loops have constant trip counts and vectorise). */
static inline __attribute__((always_inline))
void run_item_dims(kv_job *J, int64_t item, float *buf, const int32_t *gmap, const int64_t D, const int64_t DV) {
    const int64_t M = J->M, d = D, dv = DV, H = J->H;
    const int64_t bh = item / J->nsplit, split = item % J->nsplit, b = bh / H, h = bh % H;
    const kv_stream *K = &J->k, *V = &J->v;
    const int kbits = K->bits, vbits = V->bits;
    const int64_t knq = K->nq ? K->nq[bh] : K->nq_all, knr = K->nr ? K->nr[bh] : K->nr_all;
    const int64_t vnq = V->nq ? V->nq[bh] : V->nq_all;
    const int64_t L = knq + knr;
    const float scaling = J->scaling;
    float *m_i = J->pm + item * M, *l_i = J->pl + item * M, *acc = J->pacc + item * M * dv;
    float *accp = buf, *qs = accp + M * dv, *qz = qs + M * d, *lg = qz + M, *cb = lg + M * BN, *vb = cb + d + dv, *vb2 = vb + dv, *vb4 = vb2 + dv;
    const float *q = J->q + bh * M * d;
    for (int64_t r = 0; r < M; r++) { m_i[r] = -INFINITY; l_i[r] = 0.f; }
    memset(acc, 0, sizeof(float) * M * dv);
    memset(accp, 0, sizeof(float) * M * dv);
    int64_t t0 = split * J->chunk, t1 = t0 + J->chunk;
    if (t1 > L) t1 = L;
    const uint8_t *kc = K->codes ? K->codes + b * K->c_b + h * K->c_h : 0;
    const float *ks = K->scale ? K->scale + b * K->s_b + h * K->s_h : 0;
    const float *kz = K->zero ? K->zero + b * K->s_b + h * K->s_h : 0;
    const int32_t *kg = K->gid ? K->gid + b * K->g_b + h * K->g_h : 0;
    const float *kr = K->res + b * K->r_b + h * K->r_h;
    const uint8_t *vc = V->codes ? V->codes + b * V->c_b + h * V->c_h : 0;
    const float *vs = V->scale ? V->scale + b * V->s_b + h * V->s_h : 0;
    const float *vz = V->zero ? V->zero + b * V->s_b + h * V->s_h : 0;
    const float *vr = V->res + b * V->r_b + h * V->r_h;
    const int kper = kc ? 8 / kbits : 1, vper = vc ? 8 / vbits : 1;
    const int64_t kW = d / kper;
    int64_t row = -1;
    for (int64_t s0 = t0; s0 < t1; s0 += BN) {
        int64_t n = t1 - s0 < BN ? t1 - s0 : BN;
        for (int64_t j = 0; j < n; j++) {               /* logits of the block */
            int64_t t = s0 + j;
            if (t < knq) {
                int64_t g = kg ? kg[t * K->g_t] : t / K->group;
                if (g != row) {                          /* a new group row: fold its scale into the queries */
                    row = g;
                    const float *restrict sg = ks + g * K->s_t, *restrict zg = kz + g * K->s_t;
                    for (int64_t r = 0; r < M; r++) {
                        const float *restrict qr = q + r * d;
                        float *restrict o = qs + r * d;
                        float z = 0.f;
                        for (int64_t c = 0; c < d; c++) z += qr[c] * zg[c];
                        for (int f = 0; f < kper; f++)    /* field order: channel m * per + f at f * W + m */
                            for (int64_t m = 0; m < kW; m++) o[f * kW + m] = qr[m * kper + f] * sg[m * kper + f];
                        qz[r] = z;
                    }
                }
                if (j + 3 < n && t + 3 < knq && (kg ? kg[(t + 1) * K->g_t] == row && kg[(t + 2) * K->g_t] == row
                                                       && kg[(t + 3) * K->g_t] == row : (t + 3) / K->group == row)) {
                    /* four tokens of one group: the scaled queries are read once for all four */
                    for (int p = 0; p < 4; p++) unpack_any(kc + (t + p) * K->c_t, kbits, d, vb4 + p * d);
                    for (int64_t r = 0; r < M; r++) {
                        const float *restrict w = qs + r * d;
                        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
                        for (int64_t c = 0; c < d; c++) {
                            s0 += w[c] * vb4[c]; s1 += w[c] * vb4[d + c]; s2 += w[c] * vb4[2 * d + c];
                            s3 += w[c] * vb4[3 * d + c];
                        }
                        lg[r * BN + j] = (s0 + qz[r]) * scaling; lg[r * BN + j + 1] = (s1 + qz[r]) * scaling;
                        lg[r * BN + j + 2] = (s2 + qz[r]) * scaling; lg[r * BN + j + 3] = (s3 + qz[r]) * scaling;
                    }
                    j += 3;
                    continue;
                }
                unpack_any(kc + t * K->c_t, kbits, d, cb);
                const int64_t u = t + 1;
                if (j + 1 < n && u < knq && (kg ? kg[u * K->g_t] : u / K->group) == row) {
                    unpack_any(kc + u * K->c_t, kbits, d, vb);  /* two tokens of one group: the scaled queries */
                    for (int64_t r = 0; r < M; r++) {           /* are read once for both */
                        const float *restrict w = qs + r * d;
                        float s = 0.f, s1 = 0.f;
                        for (int64_t c = 0; c < d; c++) { s += w[c] * cb[c]; s1 += w[c] * vb[c]; }
                        lg[r * BN + j] = (s + qz[r]) * scaling;
                        lg[r * BN + j + 1] = (s1 + qz[r]) * scaling;
                    }
                    j++;
                    continue;
                }
                for (int64_t r = 0; r < M; r++) {
                    const float *restrict w = qs + r * d;
                    float s = 0.f;
                    for (int64_t c = 0; c < d; c++) s += w[c] * cb[c];
                    lg[r * BN + j] = (s + qz[r]) * scaling;
                }
            } else {
                const float *restrict x = kr + (t - knq) * K->r_t;
                for (int64_t r = 0; r < M; r++) {
                    const float *restrict w = q + r * d;
                    float s = 0.f;
                    for (int64_t c = 0; c < d; c++) s += w[c] * x[c];
                    lg[r * BN + j] = s * scaling;
                }
            }
        }
        for (int64_t r = 0; r < M; r++) {               /* online softmax over the block */
            int64_t limit = L - J->qlen + r % J->qlen;   /* row g*q + i sees token t iff t <= L - q + i */
            int64_t nv = limit - s0 + 1;
            if (nv > n) nv = n;
            float *restrict p = lg + r * BN;
            if (nv <= 0) { for (int64_t j = 0; j < n; j++) p[j] = 0.f; continue; }
            float mx = m_i[r];
            for (int64_t j = 0; j < nv; j++) mx = p[j] > mx ? p[j] : mx;
            float alpha = m_i[r] == -INFINITY ? 0.f : exp_neg(m_i[r] - mx);
            float sum = 0.f;
            for (int64_t j = 0; j < nv; j++) { float e = exp_neg(p[j] - mx); p[j] = e; sum += e; }
            for (int64_t j = nv; j < n; j++) p[j] = 0.f;
            l_i[r] = l_i[r] * alpha + sum;
            m_i[r] = mx;
            if (alpha != 1.f) {
                for (int64_t c = 0; c < dv; c++) { acc[r * dv + c] *= alpha; accp[r * dv + c] *= alpha; }
            }
        }
        for (int64_t j = 0; j < n; j++) {               /* weighted values of the block */
            int64_t t = s0 + j;
            if (t < vnq) {
                if (j + 3 < n && t + 3 < vnq) {         /* four tokens at once */
                    for (int p = 0; p < 4; p++)
                        value_row(vc + (t + p) * V->c_t, vs + (t + p) * V->s_t, vz + (t + p) * V->s_t, vbits, vper,
                                  V->group, dv, gmap, cb, vb4 + p * dv);
                    for (int64_t r = 0; r < M; r++) {
                        const float *wr = lg + r * BN + j;
                        const float w0 = wr[0], w1 = wr[1], w2 = wr[2], w3 = wr[3];
                        if (w0 == 0.f && w1 == 0.f && w2 == 0.f && w3 == 0.f) continue;
                        float *restrict a = accp + r * dv;
                        for (int64_t c = 0; c < dv; c++)
                            a[c] += (w0 * vb4[c] + w1 * vb4[dv + c]) + (w2 * vb4[2 * dv + c] + w3 * vb4[3 * dv + c]);
                    }
                    j += 3;
                    continue;
                }
                value_row(vc + t * V->c_t, vs + t * V->s_t, vz + t * V->s_t, vbits, vper, V->group, dv, gmap, cb, vb);
                if (j + 1 < n && t + 1 < vnq) {          /* two tokens at once: each row's sum is read and written once */
                    const int64_t u = t + 1;
                    value_row(vc + u * V->c_t, vs + u * V->s_t, vz + u * V->s_t, vbits, vper, V->group, dv, gmap, cb,
                              vb2);
                    for (int64_t r = 0; r < M; r++) {
                        const float w0 = lg[r * BN + j], w1 = lg[r * BN + j + 1];
                        if (w0 == 0.f && w1 == 0.f) continue;
                        float *restrict a = accp + r * dv;
                        for (int64_t c = 0; c < dv; c++) a[c] += w0 * vb[c] + w1 * vb2[c];
                    }
                    j++;
                    continue;
                }
                for (int64_t r = 0; r < M; r++) {
                    float w = lg[r * BN + j];
                    if (w == 0.f) continue;
                    float *restrict a = accp + r * dv;
                    for (int64_t c = 0; c < dv; c++) a[c] += w * vb[c];
                }
            } else {
                const float *restrict x = vr + (t - vnq) * V->r_t;
                for (int64_t r = 0; r < M; r++) {
                    float w = lg[r * BN + j];
                    if (w == 0.f) continue;
                    float *restrict a = acc + r * dv;
                    for (int64_t c = 0; c < dv; c++) a[c] += w * x[c];
                }
            }
        }
    }
    if (V->codes)                                        /* field order back to channel order */
        for (int64_t r = 0; r < M; r++)
            for (int64_t c = 0; c < dv; c++) acc[r * dv + c] += accp[r * dv + field_pos(c, vbits, dv)];
}

static void run_item_64(kv_job *J, int64_t item, float *buf, const int32_t *gmap) {
    run_item_dims(J, item, buf, gmap, 64, 64);
}

static void run_item_128(kv_job *J, int64_t item, float *buf, const int32_t *gmap) {
    run_item_dims(J, item, buf, gmap, 128, 128);
}

static void run_item(kv_job *J, int64_t item, float *buf, const int32_t *gmap) {
    if (J->d == 64 && J->dv == 64) run_item_64(J, item, buf, gmap);
    else if (J->d == 128 && J->dv == 128) run_item_128(J, item, buf, gmap);
    else run_item_dims(J, item, buf, gmap, J->d, J->dv);
}

static void *worker(void *arg) {
    kv_job *J = (kv_job *)arg;
    const int64_t M = J->M, d = J->d, dv = J->dv, items = J->B * J->H * J->nsplit;
    float *buf = (float *)malloc(sizeof(float) * (M * dv + M * d + M + M * BN + d + 3 * dv + 4 * (d + dv) + 16));
    int32_t *gmap = (int32_t *)malloc(sizeof(int32_t) * dv);  /* value channel in field order -> its group */
    if (!buf || !gmap) { free(buf); free(gmap); return (void *)1; }
    if (J->v.codes) {
        for (int64_t c = 0; c < dv; c++) gmap[field_pos(c, J->v.bits, dv)] = (int32_t)(c / J->v.group);
    }
    for (;;) {
        int64_t item = __atomic_fetch_add(&J->next, 1, __ATOMIC_RELAXED);
        if (item >= items) break;
        run_item(J, item, buf, gmap);
    }
    free(buf);
    free(gmap);
    return 0;
}

/* Attention of J->q [B*H, M, d] over the two streams into J->out [B*H, M, dv]; 0 on success. */
int kivi_decode(kv_job *J) {
    const int64_t M = J->M, d = J->dv, items = J->B * J->H * J->nsplit;
    int64_t nth = J->nthreads < 1 ? 1 : (J->nthreads > items ? items : J->nthreads);
    J->pm = (float *)malloc(sizeof(float) * items * M);
    J->pl = (float *)malloc(sizeof(float) * items * M);
    J->pacc = (float *)malloc(sizeof(float) * items * M * d);
    pthread_t th[64];
    int64_t started = 0, failed = 0;
    if (!J->pm || !J->pl || !J->pacc) failed = 1;
    if (nth > 64) nth = 64;
    J->next = 0;
    for (int64_t i = 1; i < nth && !failed; i++) {
        if (pthread_create(&th[started], 0, worker, J)) break;
        started++;
    }
    if (!failed && worker(J)) failed = 1;
    for (int64_t i = 0; i < started; i++) {
        void *rc = 0;
        pthread_join(th[i], &rc);
        if (rc) failed = 1;
    }
    if (!failed) {
        for (int64_t bh = 0; bh < J->B * J->H; bh++)     /* merge the splits of every head */
            for (int64_t r = 0; r < M; r++) {
                float top = -INFINITY, l = 0.f;
                for (int64_t s = 0; s < J->nsplit; s++) {
                    float m = J->pm[(bh * J->nsplit + s) * M + r];
                    if (m > top) top = m;
                }
                float *o = J->out + (bh * M + r) * d;
                for (int64_t c = 0; c < d; c++) o[c] = 0.f;
                for (int64_t s = 0; s < J->nsplit; s++) {
                    int64_t it = bh * J->nsplit + s;
                    float m = J->pm[it * M + r];
                    if (m == -INFINITY) continue;
                    float w = expf(m - top);
                    l += J->pl[it * M + r] * w;
                    const float *a = J->pacc + (it * M + r) * d;
                    for (int64_t c = 0; c < d; c++) o[c] += a[c] * w;
                }
                for (int64_t c = 0; c < d; c++) o[c] /= l;   /* l > 0: every row sees its own token */
            }
    }
    free(J->pm); free(J->pl); free(J->pacc);
    return (int)failed;
}
"""

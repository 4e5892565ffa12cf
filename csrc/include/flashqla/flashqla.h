/*
 * flashqla: Gated DeltaNet kernels for NVIDIA Hopper (sm_90a).
 *
 * Plain C API. Every entry point takes a parameter struct of raw device
 * pointers, element strides and sizes plus a cudaStream_t, launches
 * asynchronously on that stream, and returns a status code. It never
 * synchronises with the host and never allocates, so calls can be captured in
 * CUDA graphs. On failure, flashqla_last_error() returns a readable message
 * for the calling thread.
 *
 * Layout conventions (as in the PyTorch API, FLA's layout): tensors are
 * indexed [batch, time, head, dim]; strides are in elements. Packed
 * variable-length batches use batch = 1 and cu_seqlens [num_seqs + 1]
 * (int32 or int64); chunks restart at every sequence start.
 */
#ifndef FLASHQLA_FLASHQLA_H_
#define FLASHQLA_FLASHQLA_H_

#include <stdint.h>
#include <cuda_runtime_api.h>

#if defined(_WIN32)
#define FLASHQLA_API __declspec(dllexport)
#else
#define FLASHQLA_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define FLASHQLA_VERSION_MAJOR 0
#define FLASHQLA_VERSION_MINOR 1
#define FLASHQLA_VERSION_PATCH 0

typedef enum flashqla_status {
  FLASHQLA_SUCCESS = 0,
  FLASHQLA_ERROR_INVALID_ARGUMENT = 1, /* a parameter is malformed (null pointer, bad size, ...) */
  FLASHQLA_ERROR_UNSUPPORTED = 2,      /* well formed, but not supported (dtype, head dim, ...) */
  FLASHQLA_ERROR_NO_DEVICE = 3,        /* the current device is not an sm_90 GPU */
  FLASHQLA_ERROR_CUDA = 4              /* a CUDA runtime call failed; see flashqla_last_error() */
} flashqla_status_t;

typedef enum flashqla_dtype {
  FLASHQLA_FLOAT32 = 0,
  FLASHQLA_BFLOAT16 = 1,
  FLASHQLA_FLOAT16 = 2,
  FLASHQLA_INT32 = 3,
  FLASHQLA_INT64 = 4
} flashqla_dtype_t;

/* "0.1.0" */
FLASHQLA_API const char* flashqla_version(void);
/* Short name of a status code. */
FLASHQLA_API const char* flashqla_status_string(flashqla_status_t status);
/* Detailed message of the last failing call made by this thread ("" if none). */
FLASHQLA_API const char* flashqla_last_error(void);
/* FLASHQLA_SUCCESS if `device` is an sm_90 GPU the kernels were built for. */
FLASHQLA_API flashqla_status_t flashqla_check_device(int device);

/*
 * Chunk-local cumulative sum of the log-decay g, in fp32:
 *   forward: out[t] = scale * sum_{s = chunk_start(t)}^{t} g[s]
 *   reverse: out[t] = scale * sum_{s = t}^{chunk_end(t) - 1} g[s]
 * Chunks are chunk_size tokens long, aligned to each sequence's start; the
 * last chunk of a sequence may be partial. Positions that belong to no
 * sequence (past cu_seqlens[num_seqs]) are written as 0. Out-of-range
 * cu_seqlens values never cause out-of-bounds accesses.
 */
typedef struct flashqla_chunk_cumsum_params {
  const void* g;               /* [batch, seqlen, heads] */
  flashqla_dtype_t g_dtype;    /* FLOAT32, BFLOAT16 or FLOAT16 */
  int64_t g_stride_batch;
  int64_t g_stride_time;
  int64_t g_stride_head;
  float* out;                  /* [batch, seqlen, heads], contiguous */
  int64_t batch;
  int64_t seqlen;
  int64_t heads;
  const void* cu_seqlens;      /* NULL for dense batches; else [num_seqs + 1], batch must be 1 */
  flashqla_dtype_t cu_seqlens_dtype; /* INT32 or INT64 */
  int64_t num_seqs;
  int32_t chunk_size;          /* 16, 32, 64 or 128 */
  int32_t reverse;             /* 0 or 1 */
  float scale;                 /* 1.0f for a plain cumsum */
} flashqla_chunk_cumsum_params_t;

FLASHQLA_API flashqla_status_t flashqla_chunk_local_cumsum(const flashqla_chunk_cumsum_params_t* params,
                                                           cudaStream_t stream);

/*
 * Chunked gated delta rule forward (one fused kernel).
 *   S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,  o_t = scale * S_t^T q_t
 * q, k [batch, seqlen, heads_qk, head_dim_k]; v, o [batch, seqlen, heads_v, head_dim_v];
 * g, beta [batch, seqlen, heads_v]; value head h reads q/k head h / (heads_v / heads_qk).
 * The last dimension of q/k/v/o must be contiguous, their base pointers 16-byte
 * aligned and their other strides multiples of 8 elements. initial_state and
 * final_state are contiguous fp32 [num_seqs, heads_v, head_dim_k, head_dim_v]
 * (num_seqs = batch without cu_seqlens); either may be NULL. Rows of o past
 * cu_seqlens[num_seqs] are written as zeros. Supported: head_dim_k =
 * head_dim_v = 128, q/k/v bf16 or fp16 (o has v's dtype).
 */
typedef struct flashqla_gdn_fwd_params {
  const void* q;
  const void* k;
  const void* v;                         /* NULL with o = NULL: v = 0 (a transition-only pass) */
  flashqla_dtype_t qkv_dtype;            /* BFLOAT16 or FLOAT16 */
  int64_t q_stride_batch, q_stride_time, q_stride_head;
  int64_t k_stride_batch, k_stride_time, k_stride_head;
  int64_t v_stride_batch, v_stride_time, v_stride_head;
  const void* g;
  flashqla_dtype_t g_dtype;              /* FLOAT32 or BFLOAT16 */
  int64_t g_stride_batch, g_stride_time, g_stride_head;
  const void* beta;
  flashqla_dtype_t beta_dtype;           /* FLOAT32, BFLOAT16 or FLOAT16 */
  int64_t beta_stride_batch, beta_stride_time, beta_stride_head;
  void* o;                               /* NULL: summaries only (final/chunk states, no o; default kernel) */
  int64_t o_stride_batch, o_stride_time, o_stride_head;
  const float* initial_state;            /* NULL: zeros */
  float* final_state;                    /* NULL: not written */
  int64_t batch, seqlen, heads_qk, heads_v, head_dim_k, head_dim_v;
  const void* cu_seqlens;                /* NULL for dense batches */
  flashqla_dtype_t cu_seqlens_dtype;     /* INT32 or INT64 */
  int64_t num_seqs;
  float scale;
  int32_t use_qk_l2norm;                 /* 1: l2-normalise q and k rows first (eps 1e-6) */
  void* chunk_states;                    /* NULL: not written; else the state at the start of every 64-token
                                            chunk (the backward's recompute) in q's dtype (the chain keeps
                                            fp32; the backward's products read it rounded anyway),
                                            [flashqla_gdn_chunk_bound, heads_v, K, V], chunks of all
                                            sequences in order */
  void* workspace;                       /* device scratch of at least flashqla_gdn_fwd_workspace_bytes (or, for
                                            the backward, flashqla_gdn_bwd_dh_workspace_bytes); NULL or too small:
                                            the call allocates it stream-ordered (cudaMallocAsync) and frees it */
  size_t workspace_bytes;
  int32_t prep_ready;                    /* 1: the workspace already holds the chunk products (X, W) of an
                                            earlier call (ordered before this one) with the same q, k, g, beta,
                                            cu_seqlens, scale and use_qk_l2norm (v and initial_state may
                                            differ), so the prep kernel is skipped; needs a caller workspace.
                                            0: computed. A call with chunk_states set and o = NULL (the
                                            backward's recompute) computes X alone, as flashqla_gdn_bwd_prep's
                                            states_workspace holds it: such a workspace cannot serve a later
                                            prep_ready call that writes o. 2: as 1, and the chunks' gates
                                            follow X and W there (a workspace of flashqla_gdn_fwd_workspace_bytes +
                                            flashqla_gdn_fwd_gates_workspace_bytes that flashqla_gdn_bwd_prep
                                            filled as states_workspace): the summaries passes copy them. */
  /* Scheduling hints for packed batches of unequal sequences (zero-initialise both for the default; the
     results are the same bits either way). seq_order: NULL, or a device int32 permutation of the num_seqs
     sequences in the order their chains should start (longest first), read by every chain CTA (values are
     clamped into range, but only a permutation computes every sequence). prep_workers > 0 (with o): run the
     chunk products on that many worker CTAs beside the chain in one launch (the chains of the first sequences
     of seq_order start at once and wait for their chunks, the others take the workers' SMs when they finish);
     0: the library decides (single sequences and dense batches only). */
  const int32_t* seq_order;
  int32_t prep_workers;
  /* 1: no later call reads this call's workspace (no prep_ready call follows on it), so a forward with o may keep
     there only what its own chain reads: where the paired chain runs, X's 64-column operand (from the inverse) in
     X's place instead of X, which the chain then forms itself (fewer bytes through memory; the same output bits).
     0 (zero-initialised): X and W as prep_ready documents. */
  int32_t workspace_private;
} flashqla_gdn_fwd_params_t;

FLASHQLA_API flashqla_status_t flashqla_gdn_fwd(const flashqla_gdn_fwd_params_t* params, cudaStream_t stream);
/* Device workspace flashqla_gdn_fwd needs for these shapes (0: none), for params->workspace. */
FLASHQLA_API size_t flashqla_gdn_fwd_workspace_bytes(const flashqla_gdn_fwd_params_t* params);
/* Optional workspace past that minimum (0: none): a params->workspace of both sums lets the forward's prep hand its
   chain each chunk's gates (the same bits, a little faster; FLASHQLA_GATES_FROM_PREP). */
FLASHQLA_API size_t flashqla_gdn_fwd_gates_workspace_bytes(const flashqla_gdn_fwd_params_t* params);

/*
 * Backward, step 1 of 2: the gradients of the chunk states (the reverse chain over 64-token chunks).
 * `fwd` describes the forward's inputs as for flashqla_gdn_fwd (q, k, g, beta, shapes, cu_seqlens, scale,
 * use_qk_l2norm); its v, o, initial_state and final_state are ignored. dout (the gradient of o) has v's
 * layout and dtype; NULL means dO = 0 and needs fwd.prep_ready = 1 (the workspace of a prep with any dO: its W'
 * is read, its U is not). Writes dh[c, h] = the gradient of the state at the end of chunk c (chunks of all
 * sequences in order, each sequence's last one possibly partial), fp32 [num_chunks, heads_v, K, V]; dh must
 * hold flashqla_gdn_chunk_bound(fwd) chunks (entries past the last chunk are not written), or be NULL (not
 * written: a pass that wants dh0 alone, as exact parallelism's summaries passes). dh0 (NULL: not
 * written) gets the gradient of the initial state, [num_seqs, heads_v, K, V]; dht (NULL: zeros) is the
 * gradient of the final state, same layout. a (NULL: not written; else 16-byte aligned) gets the chunk-local
 * inverse A = (I + StrictLower(diag(beta) K K^T))^-1 that this step computes anyway, fp32 [batch * seqlen,
 * heads_v, 64], contiguous: row r holds row r % 64 of its chunk's A (zeros above the diagonal), for the rows
 * of every sequence (the others are not written); flashqla_gdn_bwd_grad then loads it instead of recomputing.
 */
typedef struct flashqla_gdn_bwd_dh_params {
  flashqla_gdn_fwd_params_t fwd;
  const void* dout;
  int64_t dout_stride_batch, dout_stride_time, dout_stride_head;
  const float* dht;
  float* dh;
  float* dh0;
  float* a;
} flashqla_gdn_bwd_dh_params_t;

/* An upper bound on the number of 64-token chunks of all sequences, from the shapes alone. */
FLASHQLA_API int64_t flashqla_gdn_chunk_bound(const flashqla_gdn_fwd_params_t* fwd);
FLASHQLA_API flashqla_status_t flashqla_gdn_bwd_dh(const flashqla_gdn_bwd_dh_params_t* params, cudaStream_t stream);
/* A merging pair, for exact parallelism's passes over segments: the same chain run twice with other end gradients
 * (dht), the first (the source: the pass from zero) ordered before the second.
 * flashqla_gdn_bwd_dh_merge_source is flashqla_gdn_bwd_dh, except that dh is written only by the walks that may
 * merge: those whose first half's gates sum to at most -50 (a segment with g = 0, slowly decaying or short leaves
 * its dh for the merging run to write).
 * flashqla_gdn_bwd_dh_merge is the merging run: params->dh holds the source run's dS' and other_dh0 (16-byte
 * aligned) its dh0. A walk that may merge compares its dS' with dh's at checkpoint chunks and stops at the first
 * bitwise-equal one (from there it would repeat the source's arithmetic on the same operands), leaving the source's
 * dS' in the chunks it has not reached and taking other_dh0's tile as dh0: the results of the full walk, in fewer
 * chunks where the end gradients' difference decays out of the fp32 state. Other walks, and forms that cannot stop,
 * walk in full. (A source run by flashqla_gdn_bwd_dh, which writes every chunk, serves too.) */
FLASHQLA_API flashqla_status_t flashqla_gdn_bwd_dh_merge_source(const flashqla_gdn_bwd_dh_params_t* params,
                                                                cudaStream_t stream);
FLASHQLA_API flashqla_status_t flashqla_gdn_bwd_dh_merge(const flashqla_gdn_bwd_dh_params_t* params,
                                                         const float* other_dh0, cudaStream_t stream);
/* Device workspace flashqla_gdn_bwd_dh needs (in params->fwd.workspace). With params->fwd.prep_ready = 1 it
 * holds flashqla_gdn_bwd_prep's products already and only the chain runs (a is then not written). */
FLASHQLA_API size_t flashqla_gdn_bwd_dh_workspace_bytes(const flashqla_gdn_bwd_dh_params_t* params);

/*
 * Backward, step 1 split in two: the chunk-parallel prep of flashqla_gdn_bwd_dh alone, for the same params.
 * It writes the dS chain's chunk products into params->fwd.workspace (required, at least
 * flashqla_gdn_bwd_dh_workspace_bytes) and the inverse's rows into params->a (NULL: not written). With
 * states_workspace (NULL: not written; 16-byte aligned, at least flashqla_gdn_fwd_workspace_bytes of the
 * recompute's params) it also writes the state recompute's chunk products, so the Gram products and the inverse
 * are computed once for both chains; with flashqla_gdn_fwd_gates_workspace_bytes more, the chunks' gates after
 * them (for a forward call with prep_ready = 2). Then, in either order or on two streams at once (both only read what
 * this call wrote, so each needs only to be ordered after it):
 *  - flashqla_gdn_bwd_dh with the same params and fwd.prep_ready = 1 runs the dS chain;
 *  - flashqla_gdn_fwd with chunk_states set, o = NULL, prep_ready = 1 and workspace = states_workspace runs
 *    the state recompute.
 */
FLASHQLA_API flashqla_status_t flashqla_gdn_bwd_prep(const flashqla_gdn_bwd_dh_params_t* params, void* states_workspace,
                                                     size_t states_workspace_bytes, cudaStream_t stream);

/*
 * Backward, step 2 of 2: the chunk-parallel gradient step. `fwd` describes the forward's inputs as for
 * flashqla_gdn_fwd (q, k, v, g, beta, shapes, cu_seqlens, scale, use_qk_l2norm; o, states and workspace are
 * ignored). states: the chunk-start states (flashqla_gdn_fwd with chunk_states), dh: the chunk-end state
 * gradients (flashqla_gdn_bwd_dh), [flashqla_gdn_chunk_bound(fwd), heads_v, K, V], 16-byte aligned, states in
 * q's dtype and dh in fp32. Writes, for
 * every token row r < batch * seqlen (zeros in the rows past the last sequence; nothing at all when
 * num_seqs is 0), contiguous:
 * dq, dk [rows, heads_qk, K] in dqk_dtype, the gradients with respect to the (normalised) q and k rows,
 * summed over each GVA group's value heads in head order in fp32 (pass them through the l2norm backward when
 * use_qk_l2norm: flashqla_l2norm_bwd); dqk_dtype FLOAT32 (0, what a zeroed struct holds; required with
 * use_qk_l2norm) or qkv_dtype (the fp32 sums rounded once to nearest: bitwise a cast of the FLOAT32 output);
 * dv [rows, heads_v, V] in v's dtype; dg (of the raw per-token g) and dbeta, fp32 [rows, heads_v].
 * a (NULL: the kernel computes the inverse itself; else 16-byte aligned): flashqla_gdn_bwd_dh's `a` for the
 * same inputs. The gradients are bitwise the same either way (the same code computes A in both places).
 */
typedef struct flashqla_gdn_bwd_grad_params {
  flashqla_gdn_fwd_params_t fwd;
  const void* dout;
  int64_t dout_stride_batch, dout_stride_time, dout_stride_head;
  const void* states;
  const float* dh;
  void* dq;
  void* dk;
  void* dv;
  float* dg;
  float* dbeta;
  const float* a;
  flashqla_dtype_t dqk_dtype; /* FLOAT32 or qkv_dtype: dq's and dk's */
} flashqla_gdn_bwd_grad_params_t;

FLASHQLA_API flashqla_status_t flashqla_gdn_bwd_grad(const flashqla_gdn_bwd_grad_params_t* params, cudaStream_t stream);

/*
 * The backward of the in-kernel l2norm (use_qk_l2norm): from dy, the gradient with respect to the normalised rows
 * y = x rstd, rstd = 1 / sqrt(sum x^2 + 1e-6) (the forward's l2norm), the gradient with respect to the raw rows
 * x: out = rstd (dy - y <y, dy>), computed in fp32 and written in x's dtype. For flashqla_gdn_bwd_grad's fp32 dq
 * with q (and dk with k). Rows of 128 values; rows past cu_seqlens[num_seqs] (packed sequences, batch 1) are
 * written as zeros.
 */
typedef struct flashqla_l2norm_bwd_params {
  const void* x;               /* [batch, seqlen, heads, 128], last dimension contiguous */
  flashqla_dtype_t x_dtype;    /* BFLOAT16 or FLOAT16 */
  int64_t x_stride_batch;      /* element strides, multiples of 4; x 8-byte aligned */
  int64_t x_stride_time;
  int64_t x_stride_head;
  const float* dy;             /* [batch, seqlen, heads, 128], contiguous, 16-byte aligned */
  void* out;                   /* [batch, seqlen, heads, 128] in x's dtype, contiguous, 8-byte aligned */
  int64_t batch;
  int64_t seqlen;
  int64_t heads;
  const void* cu_seqlens;      /* NULL for dense batches; else [num_seqs + 1], batch must be 1 */
  flashqla_dtype_t cu_seqlens_dtype; /* INT32 or INT64 */
  int64_t num_seqs;
} flashqla_l2norm_bwd_params_t;

FLASHQLA_API flashqla_status_t flashqla_l2norm_bwd(const flashqla_l2norm_bwd_params_t* params, cudaStream_t stream);

/*
 * Exact context parallelism's first two steps (the PyTorch op chunk_gdn_cp_fwd's): per segment of a sequence
 * (params->cu_seqlens: the segments), the affine map S_end = Phi S_start + B of its state chain, from one
 * computation of the chunk products. params as for flashqla_gdn_fwd with o = NULL, chunk_states = NULL, v not
 * NULL and final_state not NULL; it writes final_state = B (each segment's final state from
 * params->initial_state, NULL: zeros, with params->v) and transition_final = Phi (from transition_initial, the
 * identity per segment and head for Phi, with v = 0; both [num_seqs, heads_v, K, V] fp32, contiguous, 32-byte
 * aligned; K = V). With prep_ready = 0 the chunk products are left in params->workspace for a later prep_ready
 * call (the last pass, with o). A workspace of flashqla_gdn_fwd_workspace_bytes +
 * flashqla_gdn_fwd_gates_workspace_bytes runs the two chains in one launch (two state warpgroups of a CTA on the
 * loads they share); otherwise they run one after the other (FLASHQLA_SUMMARY_PAIR=0 forces that).
 */
FLASHQLA_API flashqla_status_t flashqla_gdn_fwd_cp_summaries(const flashqla_gdn_fwd_params_t* params,
                                                             const float* transition_initial, float* transition_final,
                                                             cudaStream_t stream);
/*
 * The merges of exact parallelism: a chain walked twice over the same segments from other initial states, B's walk
 * from zero (the summaries) before the walk from the true ones (the backward's state recompute, or the forward's
 * last pass with o). From the first checkpoint chunk where the second walk's fp32 state equals B's, bit for bit,
 * it would repeat B's arithmetic on the same operands, so it stops there and leaves the rest to B: the full walk's
 * results, in fewer chunks where the initial states' difference decays out of the fp32 state. Only walks whose
 * first half's gates sum to at most -50 take part (a g = 0 head, slow decay or a short segment walks in full).
 * flashqla_gdn_fwd_merge_bytes(run) is the checkpoint buffer's size for the merging run's params (the recompute: o
 * NULL, chunk_states set; the last pass: o set, chunk_states NULL), or 0 where it does not merge (then call the
 * plain entries). flashqla_gdn_fwd_cp_summaries_merge_source is flashqla_gdn_fwd_cp_summaries with the B pass as
 * the source: in the walks that may merge it also writes every chunk state into chunk_states (as the recompute
 * would) or, with params->o set and chunk_states NULL, O into params->o (as the last pass would), and its fp32 states
 * at the walk's first checkpoint chunks into checkpoints (16-byte aligned); FLASHQLA_ERROR_UNSUPPORTED where the
 * paired launch cannot run (nothing of the chains launched; with prep_ready = 0 the prep may have run: call
 * flashqla_gdn_fwd_cp_summaries then). flashqla_gdn_fwd_merge is the merging run after that source on the same
 * buffers (prep_ready): the recompute (flashqla_gdn_fwd's params with o and final_state NULL) or the last pass (o set;
 * its final_state takes source_final's tile, the source's final states, where a walk merged).
 */
FLASHQLA_API size_t flashqla_gdn_fwd_merge_bytes(const flashqla_gdn_fwd_params_t* run);
FLASHQLA_API flashqla_status_t flashqla_gdn_fwd_cp_summaries_merge_source(const flashqla_gdn_fwd_params_t* params,
                                                                          const float* transition_initial,
                                                                          float* transition_final, void* chunk_states,
                                                                          float* checkpoints, cudaStream_t stream);
FLASHQLA_API flashqla_status_t flashqla_gdn_fwd_merge(const flashqla_gdn_fwd_params_t* params, float* checkpoints,
                                                      const float* source_final, cudaStream_t stream);

/*
 * Exact context parallelism's scan over segment summaries (the PyTorch op chunk_gdn_cp_fwd's third step). A
 * sequence cut into segments first..last (consecutive, in order) has per segment the affine map
 * S_end = Phi S_start + B of its state chain (B: the segment's final state from zeros; Phi: from the identity
 * with v = 0, K = V); this writes every segment's true initial state:
 *   init[first] = h0 (zeros when h0 is NULL),   init[i + 1] = Phi_i init[i] + B_i   (fp32 FMAs).
 * phi [segments, heads, K, K], b and init [segments, heads, K, V], h0 [num_seqs, heads, K, V]: contiguous fp32,
 * 16-byte aligned. last [num_seqs], int64, ascending: each sequence's last segment (sequence s owns segments
 * last[s - 1] + 1 .. last[s]). K = V = 128. Malformed `last` values give wrong states, never an out-of-bounds
 * access.
 * reverse = 1: the adjoint walk (the backward's dS chain through segments, whose L_i is Phi_i^T): each sequence
 * from its last segment back, init[last] = h0 (zeros when NULL), init[i - 1] = Phi_i^T init[i] + B_i. 0: as above.
 */
typedef struct flashqla_gdn_cp_scan_params {
  const float* phi;
  const float* b;
  const float* h0;
  float* init;
  const void* last;
  flashqla_dtype_t last_dtype; /* INT64 */
  int64_t num_seqs;
  int64_t segments;
  int64_t heads;
  int64_t head_dim_k;
  int64_t head_dim_v;
  int32_t reverse; /* 0 or 1 */
} flashqla_gdn_cp_scan_params_t;

FLASHQLA_API flashqla_status_t flashqla_gdn_cp_scan(const flashqla_gdn_cp_scan_params_t* params, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FLASHQLA_FLASHQLA_H_ */

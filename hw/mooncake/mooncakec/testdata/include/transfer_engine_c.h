/*
 * Compile-only stand-in for Mooncake's transfer_engine_c.h, written for
 * kvflow's CI: it declares just the types, constants and functions that
 * hw/mooncake/mooncakec calls, with the signatures of Mooncake's C API, so
 * that `go vet -tags mooncake` and `go build -tags mooncake` type-check the
 * binding on a machine without Mooncake:
 *
 *     CGO_CFLAGS=-I$PWD/hw/mooncake/mooncakec/testdata/include \
 *         go vet -tags mooncake ./...
 *
 * It is not Mooncake's header and nothing links against it: a real build
 * uses the header and libraries of an installed Mooncake (see
 * hw/mooncake/README.md). When the binding starts calling something new,
 * declare it here too, or CI stops compiling the binding.
 */
#ifndef KVFLOW_STUB_TRANSFER_ENGINE_C_H
#define KVFLOW_STUB_TRANSFER_ENGINE_C_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Handles are opaque pointers; segment ids are 32-bit, batch ids 64-bit. */
typedef void *transfer_engine_t;
typedef void *transport_t;
typedef int32_t segment_id_t;
typedef uint64_t batch_id_t;

/* Request opcodes. */
#define OPCODE_READ 0
#define OPCODE_WRITE 1

/* Task states reported by getTransferStatus. */
#define STATUS_WAITING 0
#define STATUS_PENDING 1
#define STATUS_INVALID 2
#define STATUS_CANCELED 3
#define STATUS_COMPLETED 4
#define STATUS_TIMEOUT 5
#define STATUS_FAILED 6

/*
 * One transfer of a batch. Recent Mooncake releases add fields (a file id
 * for file segments); the binding sets fields by name and leaves the rest
 * zero, which both layouts accept.
 */
typedef struct transfer_request {
    int opcode;
    void *source;
    segment_id_t target_id;
    uint64_t target_offset;
    uint64_t length;
} transfer_request_t;

typedef struct transfer_status {
    int status;
    uint64_t transferred_bytes;
} transfer_status_t;

/* Engine life cycle. */
transfer_engine_t createTransferEngine(const char *metadata_conn_string,
                                       const char *local_server_name,
                                       const char *ip_or_host_name,
                                       uint64_t rpc_port, int auto_discover);
void destroyTransferEngine(transfer_engine_t engine);
transport_t installTransport(transfer_engine_t engine, const char *proto,
                             void **args);
int getLocalIpAndPort(transfer_engine_t engine, char *buf_out, size_t buf_len);

/* Memory registration. */
int registerLocalMemory(transfer_engine_t engine, void *addr, size_t length,
                        const char *location, int remote_accessible);
int unregisterLocalMemory(transfer_engine_t engine, void *addr);

/* Segments (peers). */
segment_id_t openSegment(transfer_engine_t engine, const char *segment_name);
segment_id_t openSegmentNoCache(transfer_engine_t engine,
                                const char *segment_name);
int closeSegment(transfer_engine_t engine, segment_id_t segment_id);

/* Batches. */
batch_id_t allocateBatchID(transfer_engine_t engine, size_t batch_size);
int freeBatchID(transfer_engine_t engine, batch_id_t batch_id);
int submitTransfer(transfer_engine_t engine, batch_id_t batch_id,
                   struct transfer_request *entries, size_t count);
int getTransferStatus(transfer_engine_t engine, batch_id_t batch_id,
                      size_t task_id, struct transfer_status *status);

#ifdef __cplusplus
}
#endif

#endif /* KVFLOW_STUB_TRANSFER_ENGINE_C_H */

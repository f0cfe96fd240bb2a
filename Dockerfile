# The one `dlock` image: every service, the executor, the reconciler and the operator.
#
#   docker build -t dlock:dev .
#
# Stage 1 builds the release binary with the pinned toolchain; stage 2 is a distroless base with
# glibc and nothing else (no shell, no package manager), running as the non-root user 65532.
#
# Without a registry, scripts/image builds the same image with buildah from Debian's packages
# (docs/image.md); scripts/check-image fails when its entrypoint, command, user, port, working
# directory, labels or binary path differ from this file's final stage, so keep the two in step.

FROM rust:1.95.0-bookworm AS build
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends protobuf-compiler \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The migrations are embedded at compile time (sqlx::migrate!), so the image needs no files
# beside the binary: each service applies them at start, before it listens and before /readyz
# answers, which is what keeps a new pod out of rotation until its schema is in place.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p dlock \
 && install -D -m 0755 target/release/dlock /out/dlock

FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="dlock" \
      org.opencontainers.image.description="Fenced payouts: every dlock service, the executor, the reconciler and the operator in one binary" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /out/dlock /usr/local/bin/dlock
USER 65532:65532
WORKDIR /home/nonroot
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/dlock"]
CMD ["--help"]

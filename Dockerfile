# syntax=docker/dockerfile:1
# Build: the pinned Rust toolchain plus cmake (Pingora's zlib-ng) and a C compiler.
FROM rust:1.95-slim-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake=3.25.* make=4.3-* g++=4:12.* \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock rust-toolchain.toml ./
COPY src ./src
COPY crates ./crates
COPY bench ./bench
COPY vendor ./vendor
COPY conf ./conf
RUN cargo build --release --locked --bin sluice

# Run: a slim base, no toolchain, a non-root user, config under /etc/sluice.
FROM debian:bookworm-slim
RUN groupadd --system --gid 10001 sluice \
 && useradd --system --uid 10001 --gid sluice --no-create-home --shell /usr/sbin/nologin sluice
COPY --from=build /src/target/release/sluice /usr/local/bin/sluice
COPY conf/ /etc/sluice/
USER 10001:10001
# 8080/8443 tenant-facing; 8081 operations (probes, metrics, status; off loopback all but the
# probes need SLUICE_ADMIN_TOKEN).
EXPOSE 8080 8443 8081
ENV SLUICE_OPS_LISTEN=0.0.0.0:8081
ENTRYPOINT ["/usr/local/bin/sluice"]
CMD ["serve", "--config", "/etc/sluice/sluice.yaml", "--listen", "0.0.0.0:8080"]
